"""`sgl-kvq demo`: the main job. Starts the SGLang server (CPU engine when there is no GPU) with the embedded
SmolLM2 three times at the same KV memory budget: bf16 KV, then kivi4 (the near-lossless choice) and kivi2 (the most
tokens); runs the same small multi-turn ShareGPT workload (4 conversations) against each and prints capacity,
throughput and agreement with bf16 (bench/commands/bench_multiturn.py does the work)."""

from __future__ import annotations

from bench.commands import bench_multiturn


def add_arguments(p) -> None:
    bench_multiturn.add_arguments(p)
    # 4 conversations: three servers from nothing in about 6 minutes on 2 cores (6 took 7 min here)
    p.set_defaults(conversations=4)


def run(args) -> int:
    return bench_multiturn.run(args)

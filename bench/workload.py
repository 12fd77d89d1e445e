"""A multi-turn chat workload against a running server (ShareGPT human turns, the model's chat template).

Conversations run concurrently, turns within one conversation in order, each turn resending the whole history so
the radix cache serves the earlier turns. With `reference` (another run's outputs) the assistant turns of the
history are taken from the reference instead of this run's own outputs (teacher forcing): every run then sends the
same prompts, and per-turn outputs can be compared token by token.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int]
    text: str
    latency_s: float


@dataclass
class WorkloadResult:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0

    def outputs(self) -> dict[tuple[int, int], Turn]:
        return {(t.conversation, t.turn): t for t in self.turns}

    @property
    def generated_tokens(self) -> int:
        return sum(len(t.output_ids) for t in self.turns)

    def cached_share_after_first_turn(self) -> float:
        later = [t for t in self.turns if t.turn > 0]
        return sum(t.cached_tokens for t in later) / max(sum(t.prompt_tokens for t in later), 1)


def common_prefix_share(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


def agreement(run: WorkloadResult, reference: WorkloadResult) -> dict:
    """Per-turn greedy agreement with a reference run of the same prompts."""
    ref = reference.outputs()
    shares = [common_prefix_share(t.output_ids, ref[(t.conversation, t.turn)].output_ids) for t in run.turns]
    exact = [t.output_ids == ref[(t.conversation, t.turn)].output_ids for t in run.turns]
    return {"token_agreement": sum(shares) / max(len(shares), 1), "exact_turns": sum(exact) / max(len(exact), 1)}


def run_multiturn(server, tokenizer, conversations: list[list[str]], max_new_tokens: int, concurrency: int = 4,
                  reference: WorkloadResult | None = None) -> WorkloadResult:
    ref = reference.outputs() if reference else {}

    def one(ci: int) -> list[Turn]:
        messages, done = [], []
        for ti, user in enumerate(conversations[ci]):
            messages.append({"role": "user", "content": user})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            t0 = time.perf_counter()
            out = server.post("/generate", {"text": prompt, "sampling_params": {
                "temperature": 0, "max_new_tokens": max_new_tokens}})
            meta = out["meta_info"]
            turn = Turn(ci, ti, meta["prompt_tokens"], meta["cached_tokens"], list(out.get("output_ids") or []),
                        out["text"], time.perf_counter() - t0)
            done.append(turn)
            answer = ref[(ci, ti)].text if ref else out["text"]
            messages.append({"role": "assistant", "content": answer})
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        per_conv = list(pool.map(one, range(len(conversations))))
    return WorkloadResult([t for conv in per_conv for t in conv], time.perf_counter() - t0)

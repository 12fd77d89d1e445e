"""`sgl-kvq bench serving --workload agentic` without servers: the trace loads with SGLang's own agentic-trace loader,
its conversations grow turn by turn and share no essay text, its load-generator flags parse with the load generator's
own parser, and the workload's token bound holds the templated conversations."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from bench.commands import serving_workloads as wl

CONVERSATIONS, TURNS, TURN_TOKENS, OUTPUT_LEN = 4, 4, 300, 16


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from bench import models

    return AutoTokenizer.from_pretrained(models.BUILDERS[name]())


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def trace(request, tmp_path_factory) -> tuple[Path, object]:
    from bench import models

    path = tmp_path_factory.mktemp("agentic") / f"trace-{request.param}.json"
    wl.write_agentic_trace(path, models.BUILDERS[request.param](), CONVERSATIONS, TURNS, TURN_TOKENS, OUTPUT_LEN)
    return path, _tokenizer(request.param)


def _count(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False).input_ids)


def _user_messages(conversation: list[dict]) -> list[str]:
    return [m["content"] for turn in conversation for m in turn["messages"] if m["role"] == "user"]


def _tool_words(conversation: list[dict]) -> list[str]:
    text = " ".join(re.findall(r"<tool_output>\n(.*?)\n</tool_output>", " ".join(_user_messages(conversation)),
                               re.S))
    return text.split()


def _shingles(words: list[str], n: int = 12) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_sglang_agentic_loader_reads_the_asked_conversations_and_turns(trace):
    from sglang.benchmark.datasets.agentic_trace import AgenticTraceDataset

    path, tok = trace
    rows = AgenticTraceDataset(dataset_path=str(path), num_requests=CONVERSATIONS, fixed_output_len=OUTPUT_LEN,
                               offset=0, max_turns=TURNS).load(tok)
    assert len(rows) == CONVERSATIONS
    assert all(len(r.prompt) == TURNS and r.output_len == OUTPUT_LEN for r in rows)
    first = rows[0].prompt
    assert [m["role"] for m in first[0]] == ["system", "user"] and all([m["role"] for m in t] == ["user"]
                                                                       for t in first[1:])
    fewer = AgenticTraceDataset(dataset_path=str(path), num_requests=2, fixed_output_len=OUTPUT_LEN, offset=0,
                                max_turns=2).load(tok)
    assert len(fewer) == 2 and all(len(r.prompt) == 2 for r in fewer)


def test_conversations_grow_by_a_turn_of_about_turn_tokens(trace):
    path, tok = trace
    for conversation in json.loads(path.read_text())["conversations"]:
        for user in _user_messages(conversation):
            assert abs(_count(tok, user) - TURN_TOKENS) <= 0.15 * TURN_TOKENS
        prompt = [t["prompt_tokens"] for t in conversation]
        assert all(b - a >= TURN_TOKENS for a, b in zip(prompt, prompt[1:])), prompt


def test_conversations_share_no_essay_text_and_skip_the_evaluations_text(trace):
    from bench import data

    path, _ = trace
    conversations = json.loads(path.read_text())["conversations"]
    assert json.loads(path.read_text())["metadata"]["essay_text_restarts"] == 0
    seen = _shingles(data.essay_text(min_chars=wl.AGENTIC_ESSAY_SKIP_CHARS)[:wl.AGENTIC_ESSAY_SKIP_CHARS].split())
    for conversation in conversations:
        mine = _shingles(_tool_words(conversation))
        assert len(mine) > 100 and not mine & seen
        seen |= mine


def test_loadgen_args_parse_with_the_load_generators_own_parser(monkeypatch):
    from sglang.benchmark import serving

    load = wl.agentic_workload(Path("trace.json"), CONVERSATIONS, TURNS, TURN_TOKENS, OUTPUT_LEN)
    parsed = []
    monkeypatch.setattr(serving, "run_benchmark", parsed.append)
    monkeypatch.setattr(sys, "argv", ["sglang.benchmark.serving", *load.loadgen_args, "--port", "1"])
    serving.cli_main()
    args = parsed[0]
    assert (args.backend, args.dataset_name, args.dataset_path) == ("sglang-oai-chat", "agentic-trace", "trace.json")
    assert (args.num_prompts, args.agentic_max_turns, args.sharegpt_output_len) == (CONVERSATIONS, TURNS, OUTPUT_LEN)
    assert args.output_details
    assert load.name == "agentic" and load.conversations == CONVERSATIONS and load.turns == TURNS


def test_tokens_per_conversation_bounds_the_templated_conversation(trace):
    path, tok = trace
    bound = wl.agentic_workload(path, CONVERSATIONS, TURNS, TURN_TOKENS, OUTPUT_LEN).tokens_per_conversation
    reply = tok.decode(tok(" reply" * OUTPUT_LEN, add_special_tokens=False).input_ids[:OUTPUT_LEN])
    assert _count(tok, reply) >= OUTPUT_LEN - 1
    for conversation in json.loads(path.read_text())["conversations"]:
        history = []
        for turn in conversation:
            history += [*turn["messages"], {"role": "assistant", "content": reply}]
        text = tok.apply_chat_template(history, tokenize=False)
        total = _count(tok, text)
        assert TURNS * (TURN_TOKENS + OUTPUT_LEN) <= total < bound, (total, bound)


def test_cached_share_by_turn_splits_the_per_request_arrays_turn_by_turn(tmp_path):
    from bench.commands import serving_stats as stats

    out = tmp_path / "loadgen.jsonl"
    # two conversations of three turns, conversation after conversation; the second one's last turn failed
    out.write_text(json.dumps({"completed": 5}) + "\n" + json.dumps({
        "input_lens": [100, 200, 300, 100, 200, 0], "cached_tokens": [0, 100, 250, 50, 150, 0],
        "errors": ["", "", "", "", "", "timeout"]}) + "\n")
    assert stats.cached_share_by_turn(out, 3) == pytest.approx([50 / 200, 250 / 400, 250 / 300])
    assert stats.cached_share_by_turn(out, 4) is None, "six requests are no whole conversations of four turns"
    assert stats.cached_share_by_turn(tmp_path / "missing.jsonl", 3) is None


def test_a_trace_past_the_models_context_is_refused(tmp_path):
    from types import SimpleNamespace

    from bench import models
    from bench.commands import bench_serving

    model = models.tiny_llama()  # 4,096 positions
    args = SimpleNamespace(agentic_turns=2, agentic_turn_tokens=128, output_len=8)
    assert bench_serving.write_agentic_trace(args, model, tmp_path / "fits.json", 2) is None
    args = SimpleNamespace(agentic_turns=8, agentic_turn_tokens=600, output_len=8)
    refused = bench_serving.write_agentic_trace(args, model, tmp_path / "long.json", 1)
    assert refused and "context length (4096)" in refused


def test_the_default_conversation_fits_smollm2s_context(tmp_path):
    import argparse

    from bench import models
    from bench.commands import bench_serving

    p = argparse.ArgumentParser()
    bench_serving.add_arguments(p)
    args = p.parse_args(["--workload", "agentic"])
    model = models.BUILDERS["smollm2"]()
    assert bench_serving.write_agentic_trace(args, model, tmp_path / "trace.json", 1) is None
    longest = json.loads((tmp_path / "trace.json").read_text())["metadata"]["longest_context_tokens"]
    assert 0.85 * 8192 < longest <= 8192  # the default grows a conversation to most of SmolLM2's positions

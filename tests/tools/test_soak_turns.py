"""The soak's turns (bench/soak.py Client.turn) against a fake /generate: what a turn sends and which answers it
counts as the server's error, with and without ignore_eos (`sgl-kvq bench soak --stop-at-eos`), and the
--new-tokens range the command parses."""

from __future__ import annotations

import types

import pytest

from bench import soak
from bench.commands.bench_soak import new_tokens_range


def answer(reason: str, n: int):
    body = {"output_ids": list(range(n)), "meta_info": {"finish_reason": {"type": reason}}}
    return types.SimpleNamespace(status_code=200, json=lambda: body, text="")


def run_turn(monkeypatch, ignore_eos: bool, reason: str, n_out: int | None = None):
    sent = {}

    def fake_generate(base, input_ids, max_new_tokens, timeout=900, ignore_eos=True, **extra):
        sent.update(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        return answer(reason, max_new_tokens if n_out is None else n_out)

    monkeypatch.setattr(soak, "generate", fake_generate)
    tally = soak.Tally()
    client = soak.Client("http://x", 1000, [1, 2, 3], 8192, seed=0, tally=tally, new_tokens=(20, 30),
                         ignore_eos=ignore_eos)
    client.turn()
    return sent, tally


def test_turns_ignore_eos_by_default_and_count_a_short_answer_as_a_server_error(monkeypatch):
    sent, tally = run_turn(monkeypatch, True, "length")
    assert sent["ignore_eos"] is True and 20 <= sent["max_new_tokens"] <= 30
    assert tally.counts["turns"] == 1 and not tally.counts["server_errors"]
    _, tally = run_turn(monkeypatch, True, "stop", n_out=5)
    assert tally.counts["turns"] == 0 and tally.counts["server_errors"] == 1


def test_turns_that_stop_at_eos_accept_a_stop_and_record_it_for_the_replay(monkeypatch):
    sent, tally = run_turn(monkeypatch, False, "stop", n_out=5)
    assert sent["ignore_eos"] is False
    assert tally.counts["turns"] == 1 and not tally.counts["server_errors"]
    assert tally.turns[0]["ignore_eos"] is False and len(tally.turns[0]["output_ids"]) == 5
    _, tally = run_turn(monkeypatch, False, "length", n_out=3)  # cut short yet reported as length: wrong
    assert tally.counts["server_errors"] == 1


def test_new_tokens_range():
    assert new_tokens_range("8,48") == (8, 48)
    for bad in ("48", "0,4", "9,8", "a,b"):
        with pytest.raises(SystemExit, match="--new-tokens"):
            new_tokens_range(bad)

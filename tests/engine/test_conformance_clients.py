"""Real clients against SmolLM2 served in bf16 and in kvq dtypes (tests/helpers/conformance.py: which dtypes, one server
each at the same pinned KV budget): the `openai` Python client on /v1/chat/completions and /v1/completions, streaming
and not, and the frontend-language programs of sglang/test/test_programs.py through a RuntimeEndpoint, unmodified, each
passing on a kvq dtype exactly where it passes on bf16 (bench/commands/conformance_clients.py: the checks, the
programs and why the others are left out; `sgl-kvq bench conformance` runs the same over the matrix)."""

from __future__ import annotations

import os

import pytest

from conformance import CI_CLIENT_DTYPES, LazyBaseline, against_baseline, dtypes, pinned_server, record
from bench.commands import conformance_clients as cc
from slices import ci_slice

pytestmark = [pytest.mark.slow, pytest.mark.engine]

# CI runs two short programs bf16 passes (so a kvq dtype can fail them; in the committed matrix each passes on bf16,
# kivi2 and specache2): a regex-constrained generation and tool choice (forks are in test_e2e_*.py); JSON-constrained
# and typed generation (85 s of a CI worker) join them in the matrix. Choice scoring and streamed logprobs, which bf16
# fails on SmolLM2, are in the matrix. KVQ_TEST_CONFORMANCE_PROGRAMS=all runs every program in
# conformance_clients.PROGRAMS.
CI_PROGRAMS = ["test_regex", "test_tool_use"]
RUN_PROGRAMS = list(cc.PROGRAMS) if os.environ.get("KVQ_TEST_CONFORMANCE_PROGRAMS") == "all" else CI_PROGRAMS


@pytest.fixture(scope="module")
def bf16_program_rows(tmp_path_factory):
    """bf16's program rows, its server started at the first program a kvq dtype misses."""
    from bench.models import smollm2

    def start():
        return pinned_server(smollm2(), "bf16", tmp_path_factory.mktemp("clients-bf16") / "server.log")

    baseline = LazyBaseline("programs", start, lambda server, program: cc.run_program(server.base, program))
    yield baseline.row
    baseline.close()


# CI: the completions client (the chat client, 147 s of a CI worker, joins it under KVQ_TEST_MATRIX=all; the chat
# endpoint is the kits' api_contract.test_openai_chat_completion)
@pytest.mark.parametrize("check", ci_slice(list(cc.CLIENT_CHECKS), ["openai_completions_streaming_and_not"]))
@pytest.mark.parametrize("conformance_server", dtypes(CI_CLIENT_DTYPES), indirect=True)
def test_openai_client_streaming_and_not_give_the_same_answer(conformance_server, check):
    """Each call on a flushed cache, so both read the same cold prefill: the streamed deltas must join to the
    non-streamed text, with the same finish reason and completion token count (no baseline excuse)."""
    dtype, server = conformance_server
    row = cc.client_rows(server.base, [check])[check]
    record("clients", dtype, check, row)
    assert row["outcome"] == "pass", f"{dtype} {check}: {row.get('message')}"


@pytest.mark.parametrize("program", RUN_PROGRAMS)
@pytest.mark.parametrize("conformance_server", dtypes(CI_CLIENT_DTYPES), indirect=True)
def test_frontend_program_passes_where_bf16_passes(conformance_server, bf16_program_rows, program):
    dtype, server = conformance_server
    row = cc.run_program(server.base, program)
    record("programs", dtype, program, row)
    against_baseline(bf16_program_rows, dtype, program, row)

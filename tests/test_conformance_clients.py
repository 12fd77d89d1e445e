"""Real clients against SmolLM2 served in bf16 and in kvq dtypes (tests/conformance.py: which dtypes, one server each
at the same pinned KV budget): the `openai` Python client on /v1/chat/completions and /v1/completions, streaming and
not, and the frontend-language programs of sglang/test/test_programs.py through a RuntimeEndpoint, unmodified, each
passing on a kvq dtype exactly where it passes on bf16."""

from __future__ import annotations

import os
import time
import traceback

import pytest

from conformance import against_baseline, dtypes, pinned_server, record

pytestmark = [pytest.mark.slow, pytest.mark.engine]

# test_programs.py's programs that fit a RuntimeEndpoint, with their arguments. Left out: test_image_qa (needs a
# vision model), test_completion_speculative / test_chat_completion_speculative (API speculative execution,
# num_api_spec_tokens, is for the OpenAI/Anthropic backends), test_parallel_decoding (a 512-token summary after 6
# generations: 10+ minutes of 2-core CPU decode per dtype), test_parallel_encoding (its concate_and_append join calls
# /concate_and_append_request, which SGLang 0.5.23's server does not have: 404, and the program then waits forever).
PROGRAMS = {
    "test_few_shot_qa": {}, "test_mt_bench": {}, "test_select": {"check_answer": True}, "test_decode_int": {},
    "test_decode_json_regex": {}, "test_decode_json": {}, "test_expert_answer": {}, "test_tool_use": {},
    "test_react": {}, "test_stream": {}, "test_stream_logprobs": {}, "test_regex": {},
    "test_dtype_gen": {}, "test_gen_min_new_tokens": {},
}
# CI runs two programs with short generations, choice scoring and streamed logprobs (forks are in test_e2e_*.py);
# KVQ_TEST_CONFORMANCE_PROGRAMS=all runs every program above.
CI_PROGRAMS = ["test_select", "test_stream_logprobs"]
RUN_PROGRAMS = list(PROGRAMS) if os.environ.get("KVQ_TEST_CONFORMANCE_PROGRAMS") == "all" else CI_PROGRAMS
BASELINE: dict[str, dict] = {}
QUESTION = "Name three primary colors."


@pytest.fixture(scope="module", params=dtypes())
def served(request, tmp_path_factory):
    from sgl_kvq.models import smollm2

    log = tmp_path_factory.mktemp(f"clients-{request.param}") / "server.log"
    with pinned_server(smollm2(), request.param, log) as server:
        yield request.param, server


def _openai(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=600)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_openai_client_streaming_and_not_give_the_same_answer(served, endpoint):
    """Each call on a flushed cache, so both read the same cold prefill: the streamed deltas must join to the
    non-streamed text, with the same finish reason and completion token count."""
    import requests

    dtype, server = served
    client = _openai(server)
    out = {}
    for stream in (False, True):
        # SGLang refuses a flush (400) while a request is still running or waiting, e.g. the previous call's stream
        # finishing in the scheduler after the client read its last chunk: let it wait for the queue to drain.
        requests.post(server.base + "/flush_cache", params={"timeout": 120}, timeout=180).raise_for_status()
        kw = dict(model="default", max_tokens=24, temperature=0, stream=stream)
        if stream:
            kw["stream_options"] = {"include_usage": True}
        if endpoint == "chat":
            resp = client.chat.completions.create(messages=[{"role": "user", "content": QUESTION}], **kw)
        else:
            resp = client.completions.create(prompt=f"Q: {QUESTION}\nA:", **kw)
        if not stream:
            choice = resp.choices[0]
            text = choice.message.content if endpoint == "chat" else choice.text
            out[stream] = (text, choice.finish_reason, resp.usage.completion_tokens)
            continue
        parts, finish, usage = [], None, None
        for chunk in resp:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                parts.append((c.delta.content if endpoint == "chat" else c.text) or "")
                finish = c.finish_reason or finish
        assert usage is not None, "no usage chunk with stream_options.include_usage"
        out[stream] = ("".join(parts), finish, usage.completion_tokens)
    text, finish, n = out[False]
    assert text and finish in ("stop", "length") and 0 < n <= 24, out
    assert out[True] == out[False], f"{dtype}: streamed {out[True]} vs not {out[False]}"


@pytest.mark.parametrize("program", RUN_PROGRAMS)
def test_frontend_program_passes_where_bf16_passes(served, program):
    import sglang as sgl
    from sglang.test import test_programs

    dtype, server = served
    sgl.set_default_backend(sgl.RuntimeEndpoint(server.base))
    t0 = time.perf_counter()
    try:
        getattr(test_programs, program)(**PROGRAMS[program])
        row = {"outcome": "pass"}
    except AssertionError as e:
        row = {"outcome": "fail", "message": str(e)[:400]}
    except Exception:
        row = {"outcome": "error", "message": traceback.format_exc().strip().splitlines()[-1][:400]}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    record("programs", dtype, program, row)
    against_baseline(BASELINE, dtype, program, row)

"""The frontend language's own launcher, sgl.Runtime, with a kvq dtype. It builds and resolves the server arguments in
the caller's process, where SGLang has not loaded plugins (launch_server and Engine load them first), so kvq's
resolution (page size = G, its attention backend) only runs there after `load_plugins()`: the documented way
(docs/status.md). Without it the server refuses the pool ("page size 1 != kivi2's quantization group")."""

from __future__ import annotations

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_sgl_runtime_serves_a_kvq_dtype_once_plugins_are_loaded():
    import sglang as sgl
    from sglang.srt.plugins import load_plugins

    from bench.launch import engine_kwargs
    from bench.models import tiny_llama

    @sgl.function
    def two_turns(s):
        s += "def f(x):\n    return x + 1\n" * 20
        s += sgl.gen("a1", max_tokens=8, temperature=0, ignore_eos=True)
        s += "\nclass A:\n    pass\n"
        s += sgl.gen("a2", max_tokens=8, temperature=0, ignore_eos=True)

    load_plugins()
    kw = engine_kwargs(tiny_llama(), "kivi2", max_total_tokens=4096, max_running_requests=4)
    kw.pop("log_level", None)  # sgl.Runtime takes its own
    runtime = sgl.Runtime(**kw, log_level="error")
    try:
        state = two_turns.run(backend=runtime)
        state.sync()
        assert state.error() is None, state.error()
        assert state["a1"] and state["a2"]
        pool = requests.get(runtime.url + "/get_server_info", timeout=30).json()["internal_states"][0]["kv_pool"]
    finally:
        runtime.shutdown()
    assert pool["pool_class"] == "KVQTokenToKVPool" and pool["kv_cache_dtype"] == "kivi2"
    assert pool["pages_quantized"] >= 4  # the first turn's 300-token prompt packed whole pages

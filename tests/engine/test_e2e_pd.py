"""Prefill/decode disaggregation on SGLang's CPU engine: a prefill server sends each request's packed pages and its
fp16 frames (open page, window) to a decode server through mooncake's transfer engine over TCP on loopback
(bench/pd_launch.py routes like SGLang's PD router), and the decode server continues exactly as one server with
the same dtype does: same greedy tokens and logprobs (tiny fp32 Llama). The second request reuses the first one's 4
complete pages from the prefill server's radix tree, so its window page is a radix hit the decode side must read
from the base; both go again through SGLang's PD router (sglang-router, which make setup installs). The bytes
mooncake wrote for each request (counted in the prefill server: patches/pd.py) are what the pool's descriptions
say: its pages packed plus one request slot's frames. CI runs kivi2; KVQ_TEST_PD_DTYPES=all adds bf16 (SGLang's own
pool, the byte baseline), the other non-SpeCache dtypes and kivimix (a recipe whose layers differ in width: each
layer's codes are transfer entries of their own); a comma list runs those."""

from __future__ import annotations

import json
import os
import random
import threading
import time
import urllib.request

import pytest

from sgl_kvq.config import is_kvq_dtype, parse_kv_cache_dtype
from bench.launch import ServerProcess, baseline_page_size
from sgl_kvq.pool_shape import PoolShape
from bench.models import tiny_llama
from bench.pd_launch import PDPair, Router, mooncake_available, router_available
from recipes import serve_recipe_if_asked
from slices import matrix_only

pytestmark = [pytest.mark.slow, pytest.mark.engine]

_CHOSEN = os.environ.get("KVQ_TEST_PD_DTYPES", "")
DTYPES = ["bf16", "kivi1", "kivi2", "kivi4", "gear2", "gearl2", "logquant2", "zipcache2", "kivimix"] \
    if _CHOSEN == "all" else [d for d in _CHOSEN.split(",") if d] or ["kivi2"]
L, H, D, MODEL_BYTES = 2, 2, 16, 4  # the tiny fp32 Llama: 2 layers, 2 KV heads, head_dim 16; frames in fp32
NEW_TOKENS = 12


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    first = [rng.randrange(5, 900) for _ in range(300)]  # 4 complete pages of G = 64 and an open one of 44 tokens
    return [first, first[:256] + [rng.randrange(5, 900) for _ in range(30)]]


def server_args(dtype: str) -> list[str]:
    args = ["--model-path", str(tiny_llama()), "--dtype", "float32", "--max-total-tokens", "4096",
            "--log-level", "warning", "--enable-metrics"]
    if is_kvq_dtype(dtype):
        return args + ["--kv-cache-dtype", dtype]
    return args + ["--kv-cache-dtype", dtype, "--page-size", str(baseline_page_size())]


def bootstrap_info(pd: PDPair) -> dict:
    """What the prefill server registered with its bootstrap server, as SGLang's decode side fetches it."""
    url = (f"http://127.0.0.1:{pd.bootstrap_port}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&"
           "target_pp_rank=-1")
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def answers(generate) -> list[tuple[list[int], list[float]]]:
    outs = [generate({"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0},
                      "return_logprob": True}) for ids in prompts()]
    return [(o["output_ids"], [t[0] for t in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def state_bytes(dtype: str) -> int:
    """One request slot's state items (get_request_state_buf_infos): `ring` frames of K/V per layer in the model
    dtype (zipcache2: with their fp32 saliency), and its pd_window count; none for SGLang's own pool."""
    if not is_kvq_dtype(dtype):
        return 0
    cfg = parse_kv_cache_dtype(dtype)
    G = cfg.group_size
    return cfg.ring_pages * (2 * L * G * H * D * MODEL_BYTES + (L * G * H * 4 if cfg.method == "zipcache" else 0)) + 8


def page_bytes(dtype: str, prompt_tokens: int) -> int:
    """The request's pages' items (get_contiguous_buf_infos), SGLang's bf16 pool: K and V per layer."""
    G = baseline_page_size()
    pages = -(-prompt_tokens // G)
    if not is_kvq_dtype(dtype):
        return pages * G * 2 * L * H * D * 2
    shape = PoolShape(L, H, D, 64, parse_kv_cache_dtype(dtype))
    if shape.uniform:  # a recipe's layers are entries of their own (pd_transfer.py)
        assert (len(shape.base_shapes()) * L) % 2 == 0  # no repeated entry at 2 layers
    return round(shape.base_bytes_per_token() * G * pages)


def assert_prefill_metrics_follow_its_pool_stats(prefill, requests: int):
    """kvq's PD metrics on the prefill server's /metrics (--enable-metrics, docs/metrics.md) are its pd_sent stats."""
    from scrape import by_label, kvq_families, only, scrape_when

    stats, text = scrape_when(prefill, lambda got, stats: by_label(got.get("sglang:kvq_pd_sent_bytes", []), "kind")
                              == {"kv": stats["pd_sent"]["kv_bytes"], "aux": stats["pd_sent"]["aux_bytes"]})
    got, sent = kvq_families(text), stats["pd_sent"]
    assert by_label(got["sglang:kvq_pd_sent_bytes"], "kind") == {"kv": sent["kv_bytes"], "aux": sent["aux_bytes"]}
    assert only(got["sglang:kvq_pd_sent_requests"]) == sent["requests"] == requests  # warmup excluded
    assert only(got["sglang:kvq_pd_sent_bytes_per_request"]) == pytest.approx(sent["bytes_per_request"])
    assert {labels["engine_type"] for labels, _ in got["sglang:kvq_pd_sent_bytes"]} == {"prefill"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_pd_continues_exactly_as_one_server(dtype, tmp_path, monkeypatch):
    # PD servers keep static frames; so does the single server compared with them (a request slot's static frames
    # can still hold the previous request's window pages, which pooled frames never do: the second prompt's shared
    # window page would be read in fp16 on one side and quantized on the other)
    monkeypatch.setenv("KVQ_FRAMES", "static")
    missing = mooncake_available()
    if missing:
        pytest.skip(missing)
    serve_recipe_if_asked(monkeypatch, dtype, tmp_path)
    single: dict = {}

    def run_single():  # started beside the PD pair: the machine's cores wait on the same imports
        try:
            with ServerProcess(server_args(dtype), tmp_path / "single.log") as s:
                single["answers"] = answers(lambda p: s.post("/generate", p)) + \
                    answers(lambda p: s.post("/generate", p))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            single["error"] = e

    t = threading.Thread(target=run_single)
    t.start()
    sent = []
    try:
        with PDPair(server_args(dtype), log_dir=tmp_path) as pd:
            def measured(route):
                def generate(payload):
                    before = pd.prefill.kv_pool_stats().get("pd_sent", {})
                    out = route(payload)
                    after = pd.prefill.kv_pool_stats()["pd_sent"]
                    sent.append(after["kv_bytes"] - before.get("kv_bytes", 0))
                    assert after["requests"] - before.get("requests", 0) == 1
                    return out
                return generate

            got = answers(measured(pd.generate))
            if is_kvq_dtype(dtype):  # what the decode side compares with its own (patches/pd.py)
                assert bootstrap_info(pd)["kv_layout"] == "sgl_kvq:" + parse_kv_cache_dtype(dtype).fingerprint
            # the same prompts again (now radix hits on the prefill side) through SGLang's own PD router
            if router_available():
                with Router(pd, tmp_path / "router.log") as router:
                    got += answers(measured(lambda p: router.post("/generate", p)))
            else:
                print("sglang-router is not installed: the second pass is routed by bench.pd_launch too")
                got += answers(measured(pd.generate))
            if is_kvq_dtype(dtype):
                assert_prefill_metrics_follow_its_pool_stats(pd.prefill, requests=len(got))
    finally:
        t.join()
    if "error" in single:
        raise single["error"]
    assert [ids for ids, _ in got] == [ids for ids, _ in single["answers"]]
    assert [lp for _, lp in got] == [lp for _, lp in single["answers"]]
    lengths = [len(p) for p in prompts()]
    assert sent == [page_bytes(dtype, n) + state_bytes(dtype) for n in lengths * 2]  # decode keeps no prefix
    pages, bf16 = sent[0] - state_bytes(dtype), page_bytes("bf16", lengths[0])
    print(f"{dtype}: mooncake wrote {sent[0]} B for a {lengths[0]}-token prompt: pages {pages} B "
          f"({pages / lengths[0]:.1f} B/token, bf16 pool's pages {bf16} B: {bf16 / pages:.2f}x fewer) + state "
          f"{state_bytes(dtype)} B")


@matrix_only("tests/unit/test_pd_transfer.py runs SGLang's comparison through the hook, and "
             "test_pd_continues_exactly_as_one_server reads the fingerprint the prefill server publishes")
def test_a_pair_whose_pools_differ_is_refused(tmp_path, monkeypatch):
    """Two servers whose packed pages mean different things (here the prefill side stores values unrotated, the
    decode side rotated: KVQ_ROTATE) are refused when the decode side first contacts the prefill side, with both
    fingerprints in the error (patches/pd.py): no request is answered from pages read in the wrong basis."""
    monkeypatch.setenv("KVQ_FRAMES", "static")
    missing = mooncake_available()
    if missing:
        pytest.skip(missing)
    cfg = parse_kv_cache_dtype("kivi2")
    assert cfg.rotate == "values"
    env = {"prefill": {"KVQ_ROTATE": "none"}, "decode": {"KVQ_ROTATE": "values"}}
    answered = []
    with PDPair(server_args("kivi2"), log_dir=tmp_path, env=env) as pd:
        # the prefill server would wait for the decode server's bootstrap until its timeout: route in the background
        threading.Thread(target=lambda: answered.append(pd.generate(
            {"input_ids": prompts()[0], "sampling_params": {"max_new_tokens": 4}}, timeout=300)), daemon=True).start()
        deadline = time.time() + 300
        while pd.decode.proc.poll() is None and time.time() < deadline:
            time.sleep(1)
        assert pd.decode.proc.poll() is not None, "the decode server accepted the pair"
    assert not answered
    log = (tmp_path / "decode.log").read_text(errors="replace")
    fingerprint = cfg.fingerprint
    assert f"the prefill server stores KV pages as {fingerprint.replace('values', 'none')}, the decode server as " \
           f"{fingerprint}" in log, log[-3000:]

"""`sgl-kvq bench decode` without servers: its grid, the KV bytes a step reads, the ratios, table and plot."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.commands import bench, bench_decode

GEO = {"layers": 30, "kv_heads": 3, "head_dim": 64, "max_positions": 8192, "vocab": 49152}  # SmolLM2


def args(*argv):
    p = argparse.ArgumentParser()
    bench_decode.add_arguments(p)
    return p.parse_args(list(argv))


def test_registered():
    assert "decode" in bench.BENCHMARKS


def test_grid_respects_the_model_limit_and_skips():
    pts = bench_decode.grid(args("--steps", "16"), GEO["max_positions"])
    assert (1, 8192 - 16 - 8) in pts and (8, 1024) in pts
    assert (8, 4096) not in pts and (8, 8192 - 16 - 8) not in pts  # the default skips
    assert bench_decode.grid(args("--quick"), 8192) == [(1, 1024), (1, 4096), (8, 1024)]
    with pytest.raises(SystemExit, match="leaves no point after --skip 8x4096,8xmax; pass --skip ''"):
        bench_decode.grid(args("--context", "max", "--batch", "8"), GEO["max_positions"])
    assert bench_decode.grid(args("--context", "max", "--batch", "8", "--skip", ""), 8192) == [(8, 8192 - 16 - 8)]


def test_read_bytes():
    bf16 = {"kv_bytes_per_token": 23056.0}
    assert bench_decode.read_bytes_per_step(bf16, GEO, 8, 1024) == {"kv": 8 * 1024 * 23040, "weights": 0}
    kivi2 = {"base_bytes_per_token": 3600.0, "config": {"residual": 64, "group_size": 64}}
    # 1000 tokens: the open page holds 1000 % 64 = 40, the window 64 more; the rest is packed.
    assert bench_decode.read_bytes_per_step(kivi2, GEO, 1, 1000)["kv"] == (1000 - 104) * 3600 + 104 * 23040


def test_read_bytes_of_sliding_layers_and_weights():
    """Gemma-like: layer 0 slides over 512 tokens, layer 1 reads everything; a window-only path reads layer 0 from
    the first page its window touches (position 4000 - 1 - 512 = 3487: page 54, 64 x 54 = 3456 on), the others the
    whole context; a recipe's layers are counted at their own bytes; the weights once, twice in fp32."""
    geo = {"layers": 2, "kv_heads": 1, "head_dim": 256, "sliding": [True, False], "window": 512,
           "weight_bytes": 1000}
    layer = 2 * 256 * 2
    bf16 = bench_decode.read_bytes_per_step({}, geo, 2, 4000, window_only=False, weight_factor=2.0)
    assert bf16 == {"kv": 2 * 4000 * 2 * layer, "weights": 2000}
    mix = {"base_bytes_per_token": 300.0, "layer_base_bytes_per_token": [100.0, 200.0],
           "config": {"residual": 64, "group_size": 64}}
    fp16 = 64 + (4000 - 1) % 64 + 1  # R + the open page's 32 tokens
    read = bench_decode.read_bytes_per_step(mix, geo, 1, 4000, window_only=True)
    assert read["kv"] == (4000 - 3456 - fp16) * 100 + (4000 - fp16) * 200 + 2 * fp16 * layer
    assert read["weights"] == 1000
    whole = bench_decode.read_bytes_per_step(mix, geo, 1, 4000, window_only=False)["kv"]
    assert whole - read["kv"] == 3456 * 100
    assert bench_decode.read_bytes_per_step(mix, geo, 1, 300, window_only=True)["kv"] == \
        bench_decode.read_bytes_per_step(mix, geo, 1, 300, window_only=False)["kv"]  # inside the window


def test_which_paths_read_the_window_alone(monkeypatch):
    monkeypatch.delenv("KVQ_CPU_KERNEL", raising=False)
    assert bench_decode.reads_window_only("kivi2") and bench_decode.reads_window_only("kivi4")
    assert not bench_decode.reads_window_only("auto")
    assert not bench_decode.reads_window_only("specache2") and not bench_decode.reads_window_only("gear2")
    assert not bench_decode.reads_window_only("peer_int4")
    monkeypatch.setenv("KVQ_CPU_KERNEL", "0")
    assert not bench_decode.reads_window_only("kivi2")


def test_ratios_table_plot(tmp_path):
    rows = [{"kv_cache_dtype": d, "batch": 8, "context": c, "ms_per_step": ms, "cpu_ms_per_step": cpu,
             "tok_per_s": 8000 / ms, "kv_read_bytes_per_step": b} for d, c, ms, cpu, b in
            [("auto", 1024, 200, 400, 100), ("kivi2", 1024, 100, 100, 20), ("auto", 2048, 400, 800, 200),
             ("kivi2", 2048, 400, 1000, 30)]]
    bench_decode.ratios(rows)
    assert [r["x_bf16_tok_per_s"] for r in rows] == [1.0, 2.0, 1.0, 1.0]
    assert [r["x_bf16_cpu_per_step"] for r in rows] == [1.0, 0.25, 1.0, 1.25]
    assert "| kivi2 | 8 | 1024 | 100 | 100 | 0.25 | 80.0 | 2.00 | 0.0 | 0.20 |" in bench_decode.table(rows)
    bench_decode.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_server_cpu_seconds_counts_the_whole_session():
    """The CPU time of every process in the server's session (here a busy child and its busy grandchild)."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    code = f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', {burn!r}])\n{burn}p.wait()\n" \
        "import time; time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        server = SimpleNamespace(proc=proc)
        deadline = time.time() + 60
        while bench_decode.server_cpu_seconds(server) < 0.75 and time.time() < deadline:
            time.sleep(0.2)
        assert bench_decode.server_cpu_seconds(server) >= 0.75  # both processes' 0.4 s, not one
    finally:
        proc.kill()
        proc.wait()


def test_step_seconds_is_the_median_time_per_token():
    # request 0: 0.1, 0.1, then a stall of 0.5; request 1: one chunk of two tokens in 0.4 (0.2 each), then 0.1
    arrivals = [[(0.0, 1), (0.1, 2), (0.2, 3), (0.7, 4)], [(5.0, 1), (5.4, 3), (5.5, 4)]]
    assert abs(bench_decode.step_seconds(arrivals) - 0.15) < 1e-12  # 0.1 x3, 0.2 x2, 0.5
    arrivals[0] = [(0.0, 1), (0.6, 3), (0.9, 4)]  # 0.3 x3; with request 1's 0.2 x2, 0.1: median 0.25
    assert abs(bench_decode.step_seconds(arrivals) - 0.25) < 1e-12
    assert bench_decode.step_seconds([[(1.0, 1)]]) != bench_decode.step_seconds([[(1.0, 1)]])  # NaN: no gap


def test_stream_batch_reads_every_request_token_by_token():
    """Against a stand-in server that streams SGLang's SSE lines: one request per prompt, all at once, each
    token's arrival recorded, [DONE] not counted."""
    import os
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["sampling_params"]["max_new_tokens"]
            for done in [1, 3] + list(range(4, n + 1)):  # tokens 2 and 3 in one chunk
                time.sleep(0.02)
                self.wfile.write(f"data: {json.dumps({'meta_info': {'completion_tokens': done}})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = SimpleNamespace(base=f"http://127.0.0.1:{httpd.server_port}", proc=SimpleNamespace(pid=os.getpid()))
        arrivals, cpu = bench_decode.stream_batch(server, [[1, 2], [3, 4], [5, 6]], 5)
    finally:
        httpd.shutdown()
    assert sorted(b["input_ids"] for b in seen) == [[1, 2], [3, 4], [5, 6]]
    assert all(b["stream"] and b["sampling_params"]["ignore_eos"] for b in seen)
    assert [[n for _, n in a] for a in arrivals] == [[1, 3, 4, 5]] * 3
    assert 0.005 < bench_decode.step_seconds(arrivals) < 0.5
    assert cpu >= 0.0


def test_json_is_saved_after_every_server(tmp_path, monkeypatch):
    """A run cut off after its first server (hours at B=8, 16k tokens) keeps that server's rows on disk."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                   "num_key_value_heads": 3, "hidden_size": 576,
                                                   "max_position_embeddings": 8192, "vocab_size": 49152}))
    monkeypatch.setattr(bench_decode, "equal_budget", lambda *a: 2**30)
    monkeypatch.setattr(bench_decode, "describe", lambda: {"cpu": "test"})

    def measure(model, label, *rest):
        if label != "auto":
            raise KeyboardInterrupt  # the run is stopped while the second server measures
        return [{"kv_cache_dtype": "auto", "batch": 1, "context": 1024, "ms_per_step": 50.0,
                 "cpu_ms_per_step": 90.0, "tok_per_s": 20.0, "kv_read_bytes_per_step": 1}]

    monkeypatch.setattr(bench_decode, "measure", measure)
    out = tmp_path / "d.json"
    a = args("--model", str(model), "--kv-cache-dtype", "auto,kivi2", "--context", "1024", "--batch", "1",
             "--json", str(out))
    with pytest.raises(KeyboardInterrupt):
        bench_decode.run(a)
    saved = json.loads(out.read_text())
    assert saved["complete"] is False
    assert [(r["kv_cache_dtype"], r["x_bf16_tok_per_s"]) for r in saved["runs"]] == [("auto", 1.0)]
    monkeypatch.setattr(bench_decode, "measure", lambda model, label, *rest: [
        {**r, "kv_cache_dtype": label, "tok_per_s": 40.0 if label == "kivi2" else 20.0} for r in
        measure(model, "auto")])
    bench_decode.run(a)
    saved = json.loads(out.read_text())
    assert saved["complete"] is True
    assert [r["x_bf16_tok_per_s"] for r in saved["runs"]] == [1.0, 2.0]

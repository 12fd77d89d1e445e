"""`sgl-kvq bench conformance`: SGLang's own server test kits (`sglang/test/kits/`), unmodified, against a bf16 server
and one server per kvq dtype; a kvq dtype must pass every kit test bf16 passes.

The kits are unittest mixins written for SGLang's CI: a test class mixes one in and exposes `base_url`, `process`
and `model`. Here one class per kit is built over a running `ServerProcess`, with only the kits' size attributes
set smaller (a 2-core CPU runs them) and, where a kit would download, an offline substitute from the embedded data
(bench/data.py): the KL kit's LongBench-v2 prompts become essay token ids in the kit's own cache file format,
the cache-hit kit's ShareGPT file is the embedded ShareGPT. Every kit test's outcome, run time and (for the KL kit) its
measured average KL are recorded; the KL kit compares at the kit's own threshold for every dtype.

Kits run here: basic API contract, basic decode correctness, matched stop, abort-all, basic scheduler stress,
radix-cache server, multi-turn cache hit, KL divergence (prefix and decode cache hit). The others do not fit this
engine; why, in one line each, is KITS_NOT_RUN. Each server also runs the openai client checks and test_programs.py's
programs (conformance_clients.py); `--table` prints docs/conformance.md's tables from the JSON (conformance_table.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import time
import traceback
import unittest
from pathlib import Path

from sgl_kvq import env

# The kit's own KL threshold for every dtype (SGLang's CI uses 0.002 for its dense models; a dtype that exceeds it
# is reported with its measured KL, never given a looser threshold).
KIT_KL_THRESHOLD = 0.002

# The pinned KV budget of every server: equal memory for bf16 and each kvq dtype, and room for the kits' 8k-token
# prompt (bf16 holds 46,592 SmolLM2 tokens in 1 GiB).
KV_CACHE_GB = 1.0

# Sizes. The kits' defaults are for an 8-GPU CI job (32 x 512-token KL samples, a 400-node radix tree with up to 256
# new tokens per node); these keep one server's kits to minutes on 2 CPU cores while every code path stays.
SANITY_NEW_TOKENS = {"sanity_max_new_tokens_short": 32, "sanity_max_new_tokens_long": 64}  # the kits: 64 / 128
KL_SAMPLES = 4
# Each KL prompt is 4-6 whole pages of 64 plus 34-60 tokens (the kit: 1,500-4,500 tokens), so the decode-hit turn's
# 32 new tokens complete one more page: the kit counts a decode hit only when more than the prompt is cached.
KL_PROMPT_PAGES, KL_PROMPT_TAIL = (4, 6), (34, 60)
KL_NEW_TOKENS = 32
ABORT_REQUESTS = 16  # the kit: 32 (a 2-core CPU admits them slowly; 16 still keeps requests running and queued)
ABORT_NEW_TOKENS = 2048  # aborted after the kit's 2 s; the kit's 16,000 exceeds SmolLM2's 8,192 context
RADIX_NODES = 24
RADIX_CHUNK = 32
CACHE_HIT = dict(num_clients=4, num_rounds=3, request_length=256, output_length=16)

# The order a server runs its kits in: the ones whose requests are bounded first, so a run cut off by time keeps them;
# matched stop (up to 1,000 new tokens per request until a stop string or EOS, which a 1-bit cache may never emit:
# 0.3-0.7 tok/s at 800 tokens on kivi1 with a loaded CPU) and scheduler stress (an 8k-token prompt) last.
KIT_ORDER = ["api_contract", "decode_correctness", "abort_all", "kl_divergence", "radix_cache_server", "cache_hit",
             "matched_stop", "scheduler_stress"]
# A matrix run gives one kit test this long, then aborts every request on the server and records an error: a test
# that waits on a generation that never stops must not hold the other dtypes back (bf16's slowest passing tests on
# the loaded CPU: the radix tree 272 s, a stop-string test 377 s).
KIT_TEST_TIMEOUT_S = 600

KITS_NOT_RUN = {
    "abort_timeout_kit.WaitingTimeoutMixin / RunningTimeoutTwoWaveMixin": "need a server started with "
    "SGLANG_REQ_WAITING_TIMEOUT / SGLANG_REQ_RUNNING_TIMEOUT and --max-running-requests 1: not run (owed)",
    "unified_radix_cache_kit": "checks SGLang's unified (SWA/Mamba hybrid) radix tree; kvq dtypes refuse hybrid models",
    "prefix_cache_branching_kit": "checks Mamba's chunked state checkpoints (cache_chunk_size); SmolLM2 has none",
    "spec_decoding_kit / spec_server_kits": "speculative decoding, which kvq dtypes refuse at startup",
    "pd_parity_kit": "needs a prefill and a decode server behind a router; kvq PD parity with one server is "
    "tests/engine/test_e2e_pd.py",
    "dsa_metadata_kit / fwd_occupancy_kit / attention_unittest": "GPU-only kernels and metadata (DSA, CUDA occupancy)",
    "mmmu_vlm_kit / vlm_perf_kit": "vision-language models; SmolLM2 is text-only",
    "reasoning_kit": "needs a reasoning model and --reasoning-parser (think tokens); SmolLM2 has none",
    "anthropic_messages_kit": "fits (the /v1/messages front end over the same scheduler; one test needs a vision "
    "model): not run (owed)",
    "streaming_session_kit": "needs a server started with --enable-streaming-session (KV inherited across a "
    "session's turns), not tried with kvq dtypes: not run (owed)",
    "pause_generation_kit": "fits (pause/continue in place while requests run): not run (owed)",
    "json/regex/ebnf_constrained_kit, json_mode_kit": "grammar masks act on logits, not on the KV cache; their 128 "
    "new tokens per request are hard-coded, not a size attribute to shrink (23 tests per dtype): not run",
    "eval_accuracy_kit / lm_eval_kit / perf_bench_kit": "download benchmark datasets and need GPU-scale models",
}


def server_args(model, dtype: str) -> list[str]:
    from sgl_kvq.config import is_kvq_dtype
    from bench.launch import baseline_page_size

    args = ["--model-path", str(model)]
    if is_kvq_dtype(dtype):
        return args + ["--kv-cache-dtype", dtype]
    # bf16 with the kvq page size, so cache-hit counts come in the same whole pages
    return args + ["--page-size", str(baseline_page_size())]


def dtype_knobs(entries: list[str]) -> dict[str, tuple[str, dict[str, str]]]:
    """Each --dtypes entry -> (its dtype, the KVQ_ knobs its server runs with: `kivimix:KVQ_RECIPE=smollm2-2.5`);
    an entry that is neither bf16 nor a kvq dtype is refused (served as bf16 it would be measured under its name)."""
    from sgl_kvq.config import is_kvq_dtype
    from bench.eval.engine_eval import split_knobs

    out = {e: split_knobs(e) for e in entries}
    unknown = [e for e, (dt, _) in out.items() if dt != "bf16" and not is_kvq_dtype(dt)]
    if unknown:
        raise SystemExit(f"sgl-kvq bench conformance: --dtypes {','.join(unknown)}: not bf16 or a kvq dtype "
                         "(a dtype, then its knobs: kivimix:KVQ_RECIPE=NAME)")
    return out


def prepare_offline_data(model, workdir: Path) -> dict:
    """Write the files the kits would download: LongBench-v2 substitute token ids (the KL kit's cache file, under
    workdir) and a ShareGPT JSON (the cache-hit kit's dataset_path). Returns their paths."""
    from transformers import AutoTokenizer

    from bench import data

    workdir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(model))
    from sglang.test import kl_test_utils

    longbench = workdir / "longbench"
    longbench.mkdir(exist_ok=True)
    # The kit loads `input_ids_{path}_{3000}_{48}.json` before it would download: 48 prompts, of which it uses the
    # first kl_div_max_samples. They are consecutive pieces of the essays' token stream (so no two share a prefix).
    rng = random.Random(0)
    stream = tok.encode(data.essay_text())
    prompts, at = [], 0
    while len(prompts) < kl_test_utils.DEFAULT_NUM_SAMPLES:
        n = 64 * rng.randint(*KL_PROMPT_PAGES) + rng.randint(*KL_PROMPT_TAIL)
        prompts.append(stream[at:at + n])
        at += n
    assert at <= len(stream), f"the essays hold {len(stream)} tokens, the KL prompts need {at}"
    safe = str(model).replace("/", "_").replace("\\", "_")
    kl_file = longbench / f"input_ids_{safe}_{kl_test_utils.DEFAULT_PROMPT_TOKENS}_{len(prompts)}.json"
    kl_file.write_text(json.dumps(prompts))

    sharegpt = workdir / "sharegpt.json"
    recs = [r for r in data.sharegpt() if len(r.get("conversations", [])) >= 2][:500]
    sharegpt.write_text(json.dumps(recs))
    return {"longbench_dir": str(longbench), "sharegpt": str(sharegpt)}


@contextlib.contextmanager
def offline_kits(files: dict):
    """Point the KL kit's LongBench cache at the substitute (its module global, read at call time)."""
    from sglang.test import kl_test_utils

    saved = kl_test_utils.CACHE_DIR
    kl_test_utils.CACHE_DIR = files["longbench_dir"]
    kl_test_utils._cached_input_ids.clear()
    try:
        yield
    finally:
        kl_test_utils.CACHE_DIR = saved
        kl_test_utils._cached_input_ids.clear()


def kit_classes(server, model, files: dict) -> dict[str, type]:
    """{kit name: unittest class} mixing each kit into a TestCase bound to the running server."""
    from sglang.test.kits.abort_timeout_kit import AbortAllMixin
    from sglang.test.kits.basic_api_contract_kit import BasicAPIContractMixin
    from sglang.test.kits.basic_decode_correctness_kit import BasicDecodeCorrectnessMixin
    from sglang.test.kits.basic_scheduler_stress_kit import BasicSchedulerStressMixin
    from sglang.test.kits.kl_divergence_kit import KLDivergenceMixin
    from sglang.test.kits.matched_stop_kit import MatchedStopMixin

    bound = {"base_url": server.base, "process": server.proc, "model": str(model)}
    mixins = {
        "api_contract": (BasicAPIContractMixin, {}),
        "decode_correctness": (BasicDecodeCorrectnessMixin, SANITY_NEW_TOKENS),
        "matched_stop": (MatchedStopMixin, {}),
        "abort_all": (AbortAllMixin, {"abort_all_num_requests": ABORT_REQUESTS,
                                      "abort_all_max_new_tokens": ABORT_NEW_TOKENS}),
        "scheduler_stress": (BasicSchedulerStressMixin, SANITY_NEW_TOKENS),
        "kl_divergence": (KLDivergenceMixin, {"kl_div_thres": KIT_KL_THRESHOLD, "kl_div_max_samples": KL_SAMPLES,
                                              "kl_div_prefill_max_new_tokens": KL_NEW_TOKENS,
                                              "kl_div_decode_max_new_tokens": KL_NEW_TOKENS}),
    }
    out = {name: type(f"Kit_{name}", (mixin, unittest.TestCase), {**bound, **attrs})
           for name, (mixin, attrs) in mixins.items()}
    out["radix_cache_server"] = _function_kit("test_radix_attention", lambda: _radix_cache_server(server.base))
    out["cache_hit"] = _function_kit("test_multiturn_cache_hit", lambda: _cache_hit(server.base, model, files))
    return {k: out[k] for k in KIT_ORDER}


def _function_kit(name: str, fn) -> type:
    """A kit that is a function, not a mixin, as one unittest test."""
    return type(f"Kit_{name}", (unittest.TestCase,), {name: lambda self: fn()})


def _radix_cache_server(base_url: str) -> None:
    """radix_cache_server_kit.run_radix_attention_test with its tree generator's sizes as arguments (the kit's function
    calls gen_radix_tree() at 400 nodes x up to 256 new tokens: hours of CPU decode). Same payload, same check."""
    import requests
    from sglang.test.kits.radix_cache_server_kit import gen_radix_tree

    random.seed(0)  # the kit draws the tree unseeded: the same tree for every dtype
    nodes = gen_radix_tree(num_nodes=RADIX_NODES, chunk_len=RADIX_CHUNK)
    data = {"input_ids": [n["input_ids"] for n in nodes],
            "sampling_params": [{"max_new_tokens": n["decode_len"], "temperature": 0} for n in nodes]}
    res = requests.post(base_url + "/generate", json=data)
    assert res.status_code == 200, res.text[:500]


def _cache_hit(base_url: str, model, files: dict) -> None:
    from sglang.test.kits.cache_hit_kit import run_multiturn_cache_hit_test

    run_multiturn_cache_hit_test(base_url, str(model), dataset_path=files["sharegpt"], **CACHE_HIT)


def kit_test_names() -> list[str]:
    """Every "kit.test" this module runs, without a server (for test collection)."""
    from types import SimpleNamespace

    classes = kit_classes(SimpleNamespace(base="", proc=None), "", {})
    return [f"{kit}.{t}" for kit, cls in classes.items() for t in unittest.TestLoader().getTestCaseNames(cls)]


def run_kit_test(cls: type, name: str, timeout_s: float | None = None, base_url: str = "") -> dict:
    """One kit test: {outcome pass|fail|error, seconds, message?, kl?} (kl: the KL kit's printed avg_kl_div). With
    timeout_s, a test still running then has every request on base_url aborted and is recorded as an error."""
    import threading

    result = unittest.TestResult()
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        worker = threading.Thread(target=lambda: cls(name).run(result), daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            import requests

            requests.post(base_url + "/abort_request", json={"abort_all": True}, timeout=60)
            worker.join(120)  # the kit's requests return aborted: let it finish before stdout is restored
            return {"outcome": "error", "seconds": round(time.perf_counter() - t0, 1),
                    "message": f"still running after {timeout_s} s: every request aborted"}
    row = {"outcome": "pass", "seconds": round(time.perf_counter() - t0, 1)}
    for kind, items in (("fail", result.failures), ("error", result.errors)):
        if items:
            row["outcome"] = kind
            row["message"] = _last_line(items[0][1])
    kl = re.findall(r"^avg_kl_div=([0-9.eE+-]+)$", buf.getvalue(), flags=re.M)
    if kl:
        row["kl"] = float(kl[-1])
    return row


def _last_line(tb: str) -> str:
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    return lines[-1][:600] if lines else ""


def run_kits(server, model, files: dict, only: list[str] | None = None, skip=frozenset(),
             on_kit=lambda rows: None) -> dict[str, dict]:
    """{"kit.test": row} for every kit (or the kits named in `only`), less the "kit.test" names in skip, against one
    running server; on_kit(rows of one kit) after each kit, so a cut-off run can keep them. Each test gets
    KIT_TEST_TIMEOUT_S."""
    rows = {}
    with offline_kits(files):
        for kit, cls in kit_classes(server, model, files).items():
            if only and kit not in only:
                continue
            got = {}
            try:
                for test in unittest.TestLoader().getTestCaseNames(cls):
                    if f"{kit}.{test}" not in skip:
                        got[f"{kit}.{test}"] = run_kit_test(cls, test, KIT_TEST_TIMEOUT_S, server.base)
            except Exception:  # a kit that cannot even be collected is recorded, not raised
                got[f"{kit}.*"] = {"outcome": "error", "message": _last_line(traceback.format_exc())}
            rows.update(got)
            on_kit(got)
    return rows


def regressions(baseline: dict[str, dict], rows: dict[str, dict]) -> dict[str, str]:
    """Kit tests bf16 passes that this dtype ran and did not pass, with the dtype's message. KL tests are compared
    too: their threshold is the kit's for every dtype (a dtype over it is listed here with its measured KL)."""
    out = {}
    for test, base in baseline.items():
        row = rows.get(test)
        if base["outcome"] == "pass" and row is not None and row["outcome"] != "pass":
            out[test] = f"{row['outcome']}: {row.get('message', '')}" + (f" (kl {row['kl']:.5f})" if "kl" in row
                                                                           else "")
    return out


GROUPS = ("kits", "clients", "programs")


def group_names(group: str) -> list[str]:
    """Every row name a group records per dtype (kits: "kit.test")."""
    from bench.commands import conformance_clients as cc

    return {"kits": kit_test_names, "clients": lambda: list(cc.CLIENT_CHECKS),
            "programs": lambda: list(cc.PROGRAMS)}[group]()


def missing(group: str, have: set[str]) -> list[str]:
    """What a dtype still owes a group. Kits go by whole kit: one runs again unless every one of its tests has a row
    (CI's slice records single tests of a kit)."""
    if group != "kits":
        return [n for n in group_names(group) if n not in have]
    kit_tests: dict[str, set] = {}
    for name in kit_test_names():
        kit_tests.setdefault(name.split(".")[0], set()).add(name)
    return [k for k, tests in kit_tests.items() if not tests <= have and f"{k}.*" not in have]


def baseline_failures(by_dtype: dict[str, dict]) -> set[str]:
    """What bf16 ran and did not pass in one group: a kvq dtype skips these in a matrix run (the rule only asks it to
    pass what bf16 passes; they cost the most CPU time: the 8k-token prompt alone waits out the kit's 120 s timeout)."""
    return {t for t, r in by_dtype.get("bf16", {}).items() if r["outcome"] != "pass" and t != "server"}


def run_groups(server, model, files: dict, todo: dict[str, list[str]], skip=frozenset(),
               on_rows=lambda group, rows: None) -> None:
    """The kits, client checks and programs in todo (less the names in skip) against one running server, handing
    each kit's, the clients' and each program's rows to on_rows(group, rows) as they come. Clients and programs run
    before the kits: they are bounded (24 and at most 128 new tokens), the kits' matched stop is not."""
    from bench.commands import conformance_clients as cc

    if todo.get("clients"):
        on_rows("clients", cc.client_rows(server.base, todo["clients"]))
    for program in todo.get("programs", []):
        if program not in skip:
            on_rows("programs", {program: cc.run_program(server.base, program)})
    if todo.get("kits"):
        run_kits(server, model, files, todo["kits"], skip, on_kit=lambda rows: on_rows("kits", rows))


def add_arguments(p) -> None:
    from sgl_kvq.config import DTYPE_NAMES

    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny | a model folder")
    p.add_argument("--dtypes", default=",".join(DTYPE_NAMES),
                   help="comma list of kvq dtypes (bf16 always runs first, as the baseline)")
    p.add_argument("--kits", default="", help="comma list of kit names to run (default: all)")
    p.add_argument("--groups", default=",".join(GROUPS), help="comma list of what runs against each server: kits "
                   "(SGLang's kits), clients (the openai client, streamed and not), programs (test_programs.py)")
    p.add_argument("--all-tests", action="store_true", help="run on each kvq dtype the kit tests and programs bf16 "
                   "fails too (default: skipped, listed as not run)")
    p.add_argument("--kv-cache-gb", type=float, default=KV_CACHE_GB, help="pinned KV budget per server")
    p.add_argument("--json", metavar="PATH", help="write every dtype's results here")
    p.add_argument("--logs", metavar="DIR", default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --json and run, per dtype "
                   "(bf16 included), only the kits, client checks and programs it has no rows for: a cut-off matrix "
                   "run goes on where it stopped")
    p.add_argument("--from-tests", metavar="PATH", help="build the report from the rows a pytest run of "
                   "tests/engine/test_conformance_*.py wrote with KVQ_CONFORMANCE_JSON=PATH, instead of starting "
                   "servers")
    p.add_argument("--table", action="store_true", help="print docs/conformance.md's Markdown tables (stdout) and the "
                   "KL entries over the kit's threshold (stderr) from the report in --json, instead of starting "
                   "servers")
    p.add_argument("--expected", metavar="PATH", help="with --table: the documented expected failures (JSON with "
                   "kl_over_kit_threshold, tests/data/expected_failures.json) the tables classify KL rows by; exit 1 "
                   "when the report's KL entries differ from them")


def report_from_tests(doc: dict, command: str) -> dict:
    """The report of `run` from a test run's rows ({group: {dtype: {test: row}}}), bf16 as the baseline per group."""
    from bench.commands import conformance_clients as cc

    sizes = {**SANITY_NEW_TOKENS, "kl_samples": KL_SAMPLES, "kl_prompt_pages": KL_PROMPT_PAGES,
             "kl_prompt_tail": KL_PROMPT_TAIL,
             "kl_new_tokens": KL_NEW_TOKENS, "abort_requests": ABORT_REQUESTS, "abort_new_tokens": ABORT_NEW_TOKENS,
             "radix_nodes": RADIX_NODES, "radix_chunk": RADIX_CHUNK, "cache_hit": CACHE_HIT,
             "client_max_tokens": cc.MAX_TOKENS, "program_timeout_s": cc.PROGRAM_TIMEOUT_S}
    report = {"command": command, "kv_cache_gb": KV_CACHE_GB, "sizes": sizes, "kit_kl_threshold": KIT_KL_THRESHOLD,
              "kits_not_run": KITS_NOT_RUN,
              "programs_not_run": cc.PROGRAMS_NOT_RUN, "groups": {}}
    for group, by_dtype in doc.items():
        out = report["groups"][group] = {}
        for dtype, rows in by_dtype.items():
            out[dtype] = {"tests": rows, "passed": sum(r["outcome"] == "pass" for r in rows.values())}
            if dtype != "bf16" and "bf16" in by_dtype:
                out[dtype]["regressions"] = regressions(by_dtype["bf16"], rows)
                out[dtype]["not_run"] = sorted(set(by_dtype["bf16"]) - set(rows))
    return report


def run(args) -> int:
    import sys

    if args.table:
        from bench.commands import conformance_table

        report = json.loads(Path(args.json).read_text())
        expected = json.loads(Path(args.expected).read_text())["kl_over_kit_threshold"] if args.expected else {}
        print(conformance_table.readme_tables(report, expected))  # stdout: docs/conformance.md; stderr: the entries
        entries = conformance_table.kl_entries(report)
        differs = args.expected is not None and entries != expected
        print("KL over the kit's threshold in this report" + (f" (differs from {args.expected}'s "
              "kl_over_kit_threshold: copy it there)" if differs else "") + ":\n" + json.dumps(entries, indent=1),
              file=sys.stderr)
        return 1 if differs else 0
    if args.from_tests:
        report = report_from_tests(json.loads(Path(args.from_tests).read_text()),
                                   "pytest tests/engine/test_conformance_*.py "
                                   "(rows: sgl-kvq bench conformance --from-tests)")
        text = json.dumps(report, indent=1) + "\n"
        Path(args.json).write_text(text) if args.json else print(text)
        return 0
    import tempfile

    from bench.launch import ServerProcess, run_file
    from bench.models import BUILDERS

    model = BUILDERS[args.model]() if args.model in BUILDERS else Path(args.model)
    dtypes = ["bf16"] + [d for d in args.dtypes.split(",") if d and d != "bf16"]
    knobs = dtype_knobs(dtypes)  # entry -> (dtype, its server's KVQ_ knobs), checked before any server starts
    groups = [g for g in args.groups.split(",") if g]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"--groups {','.join(sorted(unknown))}: not one of {','.join(GROUPS)}")
    only = [k for k in args.kits.split(",") if k] or None
    logs = Path(args.logs or tempfile.mkdtemp(prefix="kvq-conformance-"))
    logs.mkdir(parents=True, exist_ok=True)
    files = prepare_offline_data(model, logs / "data")
    os.environ["KVQ_KV_CACHE_GB"] = str(args.kv_cache_gb)
    command = "sgl-kvq bench conformance " + " ".join(getattr(args, "_argv", sys.argv[3:]))
    doc: dict = {g: {} for g in GROUPS}
    if args.resume and args.json and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        for group, by_dtype in old["groups"].items():
            doc[group] = {dt: {t: r for t, r in e["tests"].items() if t != "server"} for dt, e in by_dtype.items()}
        command = old["command"] + " ; " + command
    report = report_from_tests({g: d for g, d in doc.items() if d}, command)
    for dtype in dtypes:
        t0 = time.perf_counter()
        skip = set() if dtype == "bf16" or args.all_tests else set().union(*(baseline_failures(doc[g]) for g in groups))
        todo = {g: missing(g, set(doc[g].get(dtype, {})) | skip) for g in groups}
        if only and "kits" in todo:
            todo["kits"] = [k for k in todo["kits"] if k in only]
        if not any(todo.values()):
            continue
        ran: set[str] = set()

        def keep(group, rows, dtype=dtype):
            """Merge one batch of rows and write the report: a cut-off run keeps every finished kit and program."""
            nonlocal report
            doc[group][dtype] = {**doc[group].get(dtype, {}), **rows}
            ran.add(group)
            report = report_from_tests({g: d for g, d in doc.items() if d}, command)
            report["kv_cache_gb"] = args.kv_cache_gb
            report["model"] = str(args.model)  # which model's table may read it (bench/decision/sources.py)
            report.update(env.run_record())  # when, and the KVQ_ knobs every server of the run inherited
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

        try:
            # an entry's knobs go to its server alone, not to this process (whose KVQ_ knobs the report records)
            with ServerProcess(server_args(model, knobs[dtype][0]), log_path=run_file(logs, dtype),
                               env=knobs[dtype][1]) as server:
                run_groups(server, model, files, todo, skip, keep)
        except (RuntimeError, TimeoutError) as e:
            for g in todo:
                if todo[g] and g not in ran:
                    keep(g, {"server": {"outcome": "error", "message": str(e).splitlines()[0]}})
        for group in sorted(ran):
            entry = report["groups"][group][dtype]
            print(f"{dtype} {group}: {entry['passed']}/{len(entry['tests'])} pass"
                  + (f"; fails where bf16 passes: {sorted(entry['regressions'])}" if entry.get("regressions")
                     else ""), flush=True)
        print(f"{dtype}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if any(e.get("regressions") for g in report["groups"].values() for e in g.values()) else 0


if __name__ == "__main__":
    from bench.commands._subcommands import standalone_main

    raise SystemExit(standalone_main(__name__))

"""docs/conformance.md's tables and the KL entries over the kit's threshold, computed from a `sgl-kvq bench
conformance` report (`--table`), so docs/conformance.md and the documented KL bounds (tests/data/expected_failures.json,
given as `--expected`) are rerun from the JSON, never typed.

Per dtype: kit tests run and passed; failures bf16 has too (the model's, expected for every dtype); KL tests over the
kit's threshold that the documented bounds name (expected, held to their bound); every other failure where bf16
passes (a regression, listed by name); the measured KL and its bound. Then the openai client checks and the
frontend programs per dtype, held to the same rule."""

from __future__ import annotations

# A documented KL bound is this many times the measured KL: room for the noise of an average over 4 KL samples (its
# run-to-run spread is not measured), tight enough that a dtype whose KL doubles fails.
KL_BOUND_FACTOR = 1.6
KL_TESTS = {"kl_divergence.test_input_output_logprobs_match_prefill_cache_hit": "KL prefix hit",
            "kl_divergence.test_input_output_logprobs_match_decode_cache_hit": "KL decode hit"}


def _sig(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}")


def kl_entries(report: dict) -> dict[str, dict[str, dict]]:
    """{dtype: {KL test: {measured, bound}}} for every kvq dtype whose measured KL is over the kit's threshold: the
    measured avg KL to 3 significant digits and KL_BOUND_FACTOR times it to 2."""
    out: dict[str, dict[str, dict]] = {}
    threshold = report["kit_kl_threshold"]
    for dtype, entry in report["groups"].get("kits", {}).items():
        for test in KL_TESTS:
            row = entry["tests"].get(test)
            if dtype == "bf16" or row is None or "kl" not in row or row["kl"] < threshold:
                continue
            measured = _sig(row["kl"], 3)
            out.setdefault(dtype, {})[test.split(".", 1)[1]] = {"measured": measured,
                                                                 "bound": _sig(KL_BOUND_FACTOR * measured, 2)}
    return out


def _short(test: str) -> str:
    return KL_TESTS.get(test) or test.split(".", 1)[-1].removeprefix("test_")


def _names(tests) -> str:
    return ", ".join(f"`{_short(t)}`" for t in sorted(tests))


def _classify(base: dict, rows: dict, documented: dict) -> dict[str, list[str]]:
    """Split a dtype's rows against bf16's: as_bf16 (both fail), documented (KL over the kit's threshold, under the
    documented bound), regression (bf16 passes, this does not), better (this passes, bf16 does not)."""
    out: dict[str, list[str]] = {"as_bf16": [], "documented": [], "regression": [], "better": []}
    for test, row in rows.items():
        b = base.get(test)
        if b is None or row["outcome"] == b["outcome"] == "pass":
            continue
        if row["outcome"] == "pass":
            out["better"].append(test)
        elif b["outcome"] != "pass":
            out["as_bf16"].append(test)
        elif "kl" in row and row["kl"] < documented.get(test.split(".", 1)[-1], {}).get("bound", 0):
            out["documented"].append(test)
        else:
            out["regression"].append(test)
    return out


def _kl(row: dict | None) -> str:
    return f"{row['kl']:.3g}" if row and "kl" in row else "-"


def _not_run(base: dict, names: list[str]) -> str:
    """Tests bf16 ran that a dtype did not: by name (counted past 6), those bf16 fails (a matrix run skips them)
    counted."""
    skipped = [t for t in names if base[t]["outcome"] != "pass"]
    owed = [t for t in names if t not in skipped]
    other = _names(owed) if len(owed) <= 6 else f"{len(owed)} bf16 passes"
    return ", ".join(filter(None, [other, f"{len(skipped)} bf16 fails" if skipped else ""])) or "none"


def kits_table(report: dict, documented_all: dict[str, dict[str, dict]]) -> str:
    """`documented_all` ({dtype: {KL test: {measured, bound}}}, as kl_entries gives) is the bounds the tests assert:
    a KL row over the kit's threshold under its bound is a documented failure, any other a regression."""
    kits = report["groups"].get("kits", {})
    base = kits.get("bf16", {}).get("tests", {})
    lines = ["| dtype | kit tests run | pass | fail as bf16 does | KL over the kit's "
             f"{report['kit_kl_threshold']}, documented | fail where bf16 passes | not run | avg KL, prefix hit | "
             "avg KL, decode hit | KL bound, prefix / decode |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for dtype, entry in kits.items():
        rows = entry["tests"]
        kl_cells = [_kl(rows.get(t)) for t in KL_TESTS]
        if dtype == "bf16":
            failing = [t for t, r in rows.items() if r["outcome"] != "pass"]
            lines.append(f"| bf16 | {len(rows)} | {entry['passed']} | {len(failing)}: {_names(failing)} | - | "
                         f"(baseline) | - | {' | '.join(kl_cells)} | {report['kit_kl_threshold']} (the kit's) |")
            continue
        documented = documented_all.get(dtype, {})
        c = _classify(base, rows, documented)
        as_bf16 = f"{len(c['as_bf16'])}" + (f"; passes {_names(c['better'])}" if c["better"] else "")
        bound = " / ".join(str(documented[t.split('.', 1)[1]]["bound"]) if t.split(".", 1)[1] in documented
                           else "-" for t in KL_TESTS) if documented else f"{report['kit_kl_threshold']} (the kit's)"
        regress = (f"**{len(c['regression'])}: {_names(c['regression'])}**" if c["regression"] else "none")
        lines.append(f"| {dtype} | {len(rows)} | {entry['passed']} | {as_bf16} | "
                     f"{_names(c['documented']) or 'none'} | {regress} | "
                     f"{_not_run(base, entry.get('not_run', []))} | {' | '.join(kl_cells)} | {bound} |")
    return "\n".join(lines)


def clients_table(report: dict) -> str:
    clients, programs = report["groups"].get("clients", {}), report["groups"].get("programs", {})
    base_p = programs.get("bf16", {}).get("tests", {})
    checks = sorted({t for e in clients.values() for t in e["tests"]})
    head = " | ".join(f"openai {t.split('_')[1]}, streamed = not" for t in checks)
    lines = [f"| dtype | {head} | programs run | pass | fail as bf16 does | fail where bf16 passes | not run |",
             "|---|" + "---|" * (len(checks) + 5)]
    for dtype in dict.fromkeys([*clients, *programs]):
        crows = clients.get(dtype, {}).get("tests", {})
        cells = [crows[t]["outcome"] if t in crows else "-" for t in checks]
        prow = programs.get(dtype, {}).get("tests", {})
        if dtype == "bf16":
            failing = [t for t, r in prow.items() if r["outcome"] != "pass"]
            tail = f"{len(failing)}: {_names(failing)} | (baseline) | -"
        else:
            c = _classify(base_p, prow, {})
            regress = c["regression"] + c["documented"]
            tail = (f"{len(c['as_bf16'])}" + (f"; passes {_names(c['better'])}" if c["better"] else "")
                    + " | " + (f"**{len(regress)}: {_names(regress)}**" if regress else "none")
                    + " | " + _not_run(base_p, programs.get(dtype, {}).get("not_run", [])))
        passed = sum(r["outcome"] == "pass" for r in prow.values())
        lines.append(f"| {dtype} | {' | '.join(cells)} | {len(prow)} | {passed} | {tail} |")
    return "\n".join(lines)


def not_run_lists() -> str:
    """One line per kit and per program that does not run here, and why (the code's lists, which the report copies)."""
    from bench.commands.bench_conformance import KITS_NOT_RUN
    from bench.commands.conformance_clients import PROGRAMS_NOT_RUN

    return "\n".join(["Kits not run:", ""] + [f"- `{k}`: {why}" for k, why in KITS_NOT_RUN.items()]
                     + ["", "Programs of test_programs.py not run:", ""]
                     + [f"- `{p}`: {why}" for p, why in PROGRAMS_NOT_RUN.items()])


def readme_tables(report: dict, documented: dict[str, dict[str, dict]]) -> str:
    """The Markdown docs/conformance.md carries between its conformance-table markers, KL rows classified by the
    `documented` bounds."""
    return kits_table(report, documented) + "\n\n" + clients_table(report) + "\n\n" + not_run_lists()

"""Settings that make the real SGLang engine run on a CPU-only machine (docs/development.md, "CPU development
environment").

    os.environ.update(cpu_engine_env())          # before sglang is imported (children inherit it)
    engine = sglang.Engine(**engine_kwargs(bench.models.smollm2(), kv_cache_dtype="kivi2"))

Without SGLANG_USE_CPU_ENGINE=1 the scheduler dies importing vllm (rotary fallback); HF_HUB_OFFLINE=1 keeps
transformers from reaching for a hub these machines cannot reach. The CPU venv's import shims (sgl_kvq/cpu_shims)
must be on the path too; scripts/setup_env.sh does that.
"""

from __future__ import annotations

import os

CPU_ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}


def cpu_engine_env(apply: bool = True) -> dict[str, str]:
    """The environment variables the CPU engine needs; with apply=True they are also set in os.environ."""
    if apply:
        os.environ.update(CPU_ENGINE_ENV)
    return dict(CPU_ENGINE_ENV)


def engine_kwargs(model_path, **overrides) -> dict:
    """Keyword arguments for `sglang.Engine` on CPU; `overrides` win (e.g. kv_cache_dtype, page_size).

    max_total_tokens is capped so a test does not reserve ~15 GB of KV (mem_fraction_static applies on CPU);
    torch_native attention, because SGLang's Triton decode kernel returns garbage on bf16 under TRITON_INTERPRET."""
    kwargs = dict(
        model_path=str(model_path),
        device="cpu",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        dtype="bfloat16",
        max_total_tokens=8192,
        log_level="warning",
    )
    kwargs.update(overrides)
    return kwargs


# --- OpenMP thread binding for more than one rank on the CPU engine -------------------------------------------------
#
# SGLang's CPU engine gives every rank (dp_size x tp_size x pp_size scheduler processes) its own set of cores, read
# from SGLANG_CPU_OMP_THREADS_BIND ("0-31|32-63": one '|'-separated cpu list per rank, indexed by the rank's
# gpu_id). Unset, it gives each rank a whole NUMA node and refuses more ranks than nodes ("SGLANG_CPU_OMP_THREADS_BIND
# is not set ... should be smaller than or equal to number of numa node"), so `--tp-size 2` dies on a one-node
# machine. The helpers below choose a binding when the user has not: each node's physical cores split evenly among
# the ranks placed on it (ranks share cores when there are more ranks than cores). A value the user set wins and is
# checked here, before any process starts.

THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# The binding sgl_kvq chose itself (so a later launch with another rank count may replace it, and a user's value is
# never touched), and how many ranks share one NUMA node under it (patches/sizing.py divides the node's KV budget).
AUTO_BIND_ENV = "KVQ_AUTO_THREADS_BIND"
RANKS_PER_NODE_ENV = "KVQ_CPU_RANKS_PER_NODE"


class ThreadBindError(ValueError):
    """A SGLANG_CPU_OMP_THREADS_BIND value SGLang cannot run the requested ranks with."""


def rank_ids(tp_size: int = 1, dp_size: int = 1, pp_size: int = 1, *, base_gpu_id: int = 0,
             gpu_id_step: int = 1) -> list[int]:
    """The gpu_ids (= indices into the binding) of the dp x tp x pp scheduler processes SGLang starts on one node
    (its own count of ranks for the binding check, distributed/bootstrap.py)."""
    ranks = max(int(tp_size or 1) * int(dp_size or 1) * int(pp_size or 1), 1)
    return [int(base_gpu_id or 0) + i * int(gpu_id_step or 1) for i in range(ranks)]


def cpus_by_node() -> list[list[int]]:
    """Physical cores the process may run on, per NUMA node, as SGLang counts them (its numbering, its order)."""
    try:
        from sglang.srt.utils.common import get_cpu_ids_by_node

        nodes = [[int(c) for c in ids.split(",")] for ids in get_cpu_ids_by_node() if ids]
    except Exception:  # noqa: BLE001 - lscpu missing or an unexpected format: one node of the allowed cpus
        nodes = []
    return nodes or [sorted(os.sched_getaffinity(0))]


def auto_threads_bind(ids: list[int], nodes: list[list[int]]) -> str | None:
    """A binding for the ranks `ids` over `nodes`, or None when SGLang's own default (a node per rank) serves."""
    if len(ids) <= len(nodes):
        return None
    per_node = -(-len(ids) // len(nodes))
    groups: list[str] = []
    for i in range(len(ids)):
        node = nodes[i // per_node]
        on_node = min(per_node, len(ids) - (i // per_node) * per_node)
        k = i % per_node
        if len(node) >= on_node:  # contiguous, near-equal slices of the node's cores
            lo, hi = k * len(node) // on_node, (k + 1) * len(node) // on_node
            cpus = node[lo:hi]
        else:  # more ranks than cores: ranks take turns on the cores
            cpus = [node[k % len(node)]]
        groups.append(",".join(map(str, cpus)))
    bind = [groups[0]] * (max(ids) + 1)  # indices no rank uses (base_gpu_id > 0) still need an entry
    for i, gid in enumerate(ids):
        bind[gid] = groups[i]
    return "|".join(bind)


def _parse_cpu_list(entry: str) -> list[int]:
    cpus = []
    for part in entry.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(part)
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(part)
        cpus.extend(range(a, b + 1))
    return cpus


def check_threads_bind(value: str, ids: list[int], allowed: set[int] | None = None) -> None:
    """Raise ThreadBindError unless `value` gives every rank in `ids` a non-empty list of cpus this process may use."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    where = f"{THREADS_BIND_ENV}={value!r}"
    entries = value.split("|")
    for i, entry in enumerate(entries):
        try:
            cpus = _parse_cpu_list(entry)
        except ValueError as e:
            raise ThreadBindError(f"{where}: entry {i} {entry!r} is not a cpu list like '0-3' or '0,2' "
                                  f"(bad part {str(e)!r}); entries are separated by '|', one per rank") from None
        bad = sorted(set(cpus) - allowed)
        if bad:
            raise ThreadBindError(f"{where}: entry {i} names cpus {bad} this process cannot run on (allowed: "
                                  f"{_ranges(sorted(allowed))})")
    if max(ids) >= len(entries):
        raise ThreadBindError(f"{where} has {len(entries)} entries, but {len(ids)} rank(s) need entries for indices "
                              f"{ids} (one per dp x tp x pp rank); unset it to let sgl_kvq split the cores, or give "
                              f"e.g. {auto_threads_bind(ids, [sorted(allowed)]) or '0|1'!r}")


def _ranges(cpus: list[int]) -> str:
    out, start = [], None
    for j, c in enumerate(cpus):
        if start is None:
            start = c
        if j + 1 == len(cpus) or cpus[j + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def apply_threads_bind(ids: list[int], nodes: list[list[int]] | None = None) -> str | None:
    """Make SGLANG_CPU_OMP_THREADS_BIND fit the ranks `ids` in os.environ (SGLang's processes inherit it): a user's
    value is checked and kept; otherwise one is chosen (or a previous automatic one removed when SGLang's default
    serves). Returns the binding in force (None: SGLang's default)."""
    current = os.environ.get(THREADS_BIND_ENV)
    if current and current != os.environ.get(AUTO_BIND_ENV):
        check_threads_bind(current, ids)
        os.environ.pop(RANKS_PER_NODE_ENV, None)
        return current
    nodes = cpus_by_node() if nodes is None else nodes
    bind = auto_threads_bind(ids, nodes)
    if bind is None:
        for var in (THREADS_BIND_ENV, AUTO_BIND_ENV, RANKS_PER_NODE_ENV):
            os.environ.pop(var, None)
        return None
    os.environ[THREADS_BIND_ENV] = os.environ[AUTO_BIND_ENV] = bind
    os.environ[RANKS_PER_NODE_ENV] = str(-(-len(ids) // len(nodes)))
    return bind

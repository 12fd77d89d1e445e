"""The decision table's cells: for bf16 and every served dtype, each number read from the newest result file that
measured it, with that file named; a number no file holds stays missing (never estimated).

Bytes per token are not measured: they are the packed layout's for the table's model's shape (sgl_kvq.layout,
every knob at its default; bench/decision/models.py). The rest, per column (bench/decision/sources.py
says which files count and how old each is):

    capacity    tokens per GiB of KV budget against bf16's at SGLang's own sizing (`bench capacity`'s
                --mem-fraction-static rows; the largest fraction a file ran), x_bf16_per_budget
    attn        attention output error against fp16 (`eval attention`, the dtype's method in
                bench.eval.attention.DTYPE_METHODS), the mean over the layers of the newest attention file; an
                older file with per-layer values is averaged over those same layers
    ppl, ppl_delta  perplexity over the cached turns (`eval ppl`) and its change against the bf16 row of the same
                file; both come from one file: the newest that also ran bf16, else the newest (no delta)
    needles     answered / asked (`eval niah`): the reporting half of the needle set where the file's trials say
                their half, every trial of the file where they predate the split
    agree       greedy tokens equal to bf16's, the share of positions (`eval agree`)
    kl_prefill, kl_decode  the average KL of SGLang's KL kit, prefix-cache hit and decode-cache hit
                (`bench conformance`)

Where a dtype's defaults changed what its engine runs compute (bench/decision/defaults_history.py), its ppl,
needles, agree and KL cells come only from files measured since; capacity and the offline attention error do not
depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from bench.decision.defaults_history import RECIPE_ROW, defaults_changed, row_config
from bench.decision.models import SMOLLM2, TableModel
from bench.decision.sources import Source
from sgl_kvq.strategies import strategy_of

BF16 = "bf16"
MISSING = "—"
LAYOUT = "layout"  # the source of the bytes column: computed, not measured
KL_TESTS = {"kl_prefill": "kl_divergence.test_input_output_logprobs_match_prefill_cache_hit",
            "kl_decode": "kl_divergence.test_input_output_logprobs_match_decode_cache_hit"}
# The measured columns, grouped as they are read together from one file (bytes per token are computed).
GROUPS = (("capacity",), ("attn",), ("ppl", "ppl_delta"), ("needles",), ("agree",), ("kl_prefill", "kl_decode"))
ENGINE_KINDS = frozenset({"ppl", "niah", "agree", "conformance"})  # files whose numbers a served engine computed
OLD_NEEDLES = "†"  # a niah file from before the needle set's split: all its trials
OTHER_LAYERS = "‡"  # an attention file without per-layer values on the reference layers: its own mean
OVER_KIT = "✗"  # a KL above the kit's threshold


@dataclass(frozen=True)
class Cell:
    value: float | None  # the number plotted and compared; None: missing
    text: str
    source: str | None = None  # the file's label, LAYOUT, or None
    mark: str = ""

    @property
    def missing(self) -> bool:
        return self.value is None


NONE = Cell(None, MISSING)


@dataclass
class Row:
    dtype: str
    group: str  # "bf16", "ours", "recipe" (ours, a shipped recipe's widths) or "peer"
    cells: dict[str, Cell] = field(default_factory=dict)

    def cell(self, column: str) -> Cell:
        return self.cells.get(column, NONE)


@dataclass
class Table:
    rows: list[Row]
    sources: list[Source]  # every file read, oldest first
    skipped: list[tuple[str, str]]  # files of a known kind not read, and why
    attention_layers: list[int] | None  # the layers the attention column averages
    model: TableModel = SMOLLM2

    def row(self, dtype: str) -> Row:
        return next(r for r in self.rows if r.dtype == dtype)


def served_dtypes(model: TableModel = SMOLLM2) -> list[tuple[str, str]]:
    """(dtype, "ours" | "peer" | "recipe") in the registry's order, bf16 first, then kivimix with each shipped recipe
    made for the model."""
    from sgl_kvq.formats import peers, registry

    peer_names = {f.family for f in peers.FORMATS}
    return [(BF16, BF16)] + [(n, "peer" if n in peer_names else "ours") for n in registry.DTYPE_NAMES] + \
        [(RECIPE_ROW + name, "recipe") for name in model_recipes(model)]


def model_recipes(model: TableModel) -> list[str]:
    """The shipped recipes whose model binding is the table model's geometry."""
    from sgl_kvq.recipe import load_recipe, shipped

    s = model.shape
    bound = {name: load_recipe(name).model for name in shipped()}
    geometry = (s.layers, s.kv_heads, s.head_dim)
    return [name for name, m in bound.items() if (m.layers, m.kv_heads, m.head_dim) == geometry]


def _name(raw: str) -> str:
    return BF16 if raw in ("auto", "bf16") else raw  # the evaluations' and the conformance run's names


# --- bytes per token ------------------------------------------------------------------------------------------------

def _pool_shape(dtype: str, model: TableModel):
    from sgl_kvq.pool_shape import PoolShape

    shape = model.shape
    return PoolShape(layers=shape.layers, heads=shape.kv_heads, head_dim=shape.head_dim, num_pages=0,
                     cfg=row_config(dtype))


def host_bytes(dtype: str, model: TableModel = SMOLLM2) -> int:
    """Host RAM per token the dtype keeps besides its device pool (SpeCache's 16-bit tier), else 0."""
    import torch

    if dtype == BF16:
        return 0
    pool = _pool_shape(dtype, model)
    return strategy_of(pool.cfg).host_bytes_per_token(pool, getattr(torch, model.shape.dtype))


def bytes_cell(dtype: str, model: TableModel = SMOLLM2) -> Cell:
    if dtype == BF16:
        dense = model.shape.dense_bytes_per_token()
        return Cell(float(dense), f"{dense:,}", LAYOUT)
    device = _pool_shape(dtype, model).base_bytes_per_token()
    host = host_bytes(dtype, model)
    return Cell(device, f"{device:,.0f}" + (f" + {host:,} host" if host else ""), LAYOUT)


# --- one file's cells -----------------------------------------------------------------------------------------------

def capacity_cells(src: Source) -> dict[str, dict[str, Cell]]:
    best: dict[str, tuple[float, float]] = {}
    for r in src.data["runs"]:
        fraction = (r.get("budget") or {}).get("mem_fraction_static")
        ratio = r.get("x_bf16_per_budget", r.get("x_bf16"))
        if fraction is None or ratio is None or "refused" in r:
            continue
        dtype = _name(r["kv_cache_dtype"])
        if dtype not in best or fraction > best[dtype][0]:
            best[dtype] = (fraction, ratio)
    return {d: {"capacity": Cell(x, f"{x:.2f}x", src.label)} for d, (_, x) in best.items()}


def attention_cells(src: Source, layers: list[int] | None) -> dict[str, dict[str, Cell]]:
    from bench.eval.attention import DTYPE_METHODS, REFERENCE

    methods = {**DTYPE_METHODS, BF16: REFERENCE}
    file_layers = src.data.get("layers") or []
    out = {}
    for dtype, method in methods.items():
        m = src.data["methods"].get(method)
        if m is None:
            continue
        per_layer = dict(zip(file_layers, (m.get("per_layer") or {}).get("attn_err", [])))
        if layers and all(i in per_layer for i in layers):
            err, mark = sum(per_layer[i] for i in layers) / len(layers), ""
        else:
            err, mark = m["attn_err"], OTHER_LAYERS
        out[dtype] = {"attn": Cell(err, f"{err:.3f}", src.label, mark)}
    return out


def ppl_cells(src: Source) -> dict[str, dict[str, Cell]]:
    rows = {_name(r["kv_cache_dtype"]): r for r in src.data["results"] if "ppl_cached_turns" in r}
    base = rows.get(BF16)
    out = {}
    for dtype, r in rows.items():
        ppl = r["ppl_cached_turns"]
        out[dtype] = {"ppl": Cell(ppl, f"{ppl:.2f}", src.label)}
        if base is not None:
            delta = 100 * (ppl / base["ppl_cached_turns"] - 1)
            out[dtype]["ppl_delta"] = Cell(delta, f"{delta:+.1f}%", src.label)
    return out


def needle_cells(src: Source) -> dict[str, dict[str, Cell]]:
    out = {}
    for r in src.data["results"]:
        if not r.get("kv_cache_dtype") or not r.get("trials"):
            continue
        trials = r["trials"]
        split = any("half" in t for t in trials)
        asked = [t for t in trials if t.get("half") == "report"] if split else trials
        if not asked:  # a run of the choosing half (or a single custom needle) reports nothing
            continue
        hits = sum(bool(t["hit"]) for t in asked)
        out[_name(r["kv_cache_dtype"])] = {
            "needles": Cell(hits / len(asked), f"{hits}/{len(asked)}", src.label, "" if split else OLD_NEEDLES)}
    return out


def agree_cells(src: Source) -> dict[str, dict[str, Cell]]:
    return {_name(r["kv_cache_dtype"]): {"agree": Cell(r["match_frac"], f"{r['match_frac']:.3f}", src.label)}
            for r in src.data["results"] if "match_frac" in r}


def kl_cells(src: Source) -> dict[str, dict[str, Cell]]:
    threshold = src.data.get("kit_kl_threshold")
    out = {}
    for dtype, group in ((src.data.get("groups") or {}).get("kits") or {}).items():
        cells = {}
        for column, test in KL_TESTS.items():
            kl = ((group.get("tests") or {}).get(test) or {}).get("kl")
            if kl is not None:
                over = threshold is not None and kl > threshold
                cells[column] = Cell(kl, f"{kl:.3g}", src.label, OVER_KIT if over else "")
        if cells:
            out[_name(dtype)] = cells
    return out


READERS = {"capacity": capacity_cells, "ppl": ppl_cells, "niah": needle_cells, "agree": agree_cells,
           "conformance": kl_cells}


def attention_layers(sources: list[Source]) -> list[int] | None:
    """The set every attention cell is averaged over where it can be: of the attention files' layer sets, the one
    the most files hold per layer (a file of every layer holds any set), the newest on a tie; so one new file
    of other layers does not turn every older cell into its own mean (‡)."""
    sets = [tuple(s.data.get("layers") or ()) for s in sources if s.kind == "attention"]
    sets = [x for x in sets if x]
    if not sets:
        return None
    covered = [(sum(set(x) <= set(y) for y in sets), i) for i, x in enumerate(sets)]
    return list(sets[max(covered)[1]])


def merge(found: list[tuple[Source, dict[str, dict[str, Cell]]]], dtype: str) -> dict[str, Cell]:
    """For each group of columns, the cells of the file that holds most of the group for `dtype`, the newest of
    those (`found` is oldest first)."""
    out = {}
    for group in GROUPS:
        best, best_key = None, None
        for src, cells in found:
            held = {c: cells[dtype][c] for c in group if c in cells.get(dtype, {})}
            if held and (best_key is None or (len(held), src.order) >= best_key):
                best, best_key = held, (len(held), src.order)
        out.update(best or {})
    return out


def collect(sources: list[Source], skipped: list[tuple[str, str]] | None = None,
            model: TableModel = SMOLLM2) -> Table:
    """`model`'s table from `sources` (oldest first, as sources.load returns them for that model)."""
    layers = attention_layers(sources)
    found = []
    for src in sources:
        reader = READERS.get(src.kind)
        cells = attention_cells(src, layers) if src.kind == "attention" else reader(src)
        found.append((src, cells))
    rows, stale = [], {}
    for dtype, group in served_dtypes(model):
        row = Row(dtype, group, {"bytes": bytes_cell(dtype, model)})
        since = defaults_changed(dtype)
        usable = found
        if since is not None:
            older = {src.label for src, cells in found
                     if src.kind in ENGINE_KINDS and src.time < since and dtype in cells}
            usable = [(src, cells) for src, cells in found if src.label not in older]
            for label in older:
                stale.setdefault(label, []).append(f"{dtype} (since {_iso(since)})")
        row.cells.update(merge(usable, dtype))
        rows.append(row)
    skipped = list(skipped or []) + [(label, f"its rows of {', '.join(d)}: measured before the dtype's defaults "
                                             "changed") for label, d in stale.items()]
    return Table(rows, sources, sorted(skipped), layers, model)


def _iso(t: float) -> str:
    from datetime import timezone

    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

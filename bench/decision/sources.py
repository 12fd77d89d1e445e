"""The result files the decision table reads: what each measured, when, and whether it ran as a user who sets nothing
would (every knob at its default) on the table's model.

A file's kind comes from its content, not its name: `sgl-kvq eval ppl|agree|niah` write `"eval"`, `eval attention`
writes `methods` and `capture_check`, `bench capacity` writes `runs` with budget labels, `bench conformance` writes
`groups` and the KL kit's threshold. JSON files of other kinds (decode, serving, soak) are not read.

When: the JSON's `finished_at` where the writer records it; else, for a file git tracks unchanged, the author time
of the last commit that touched it (a checkout's file times are the checkout's, and a rebase keeps author times);
else the file's modification time.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.decision.models import SMOLLM2, UNRECORDED, TableModel

# The threads and the kernel that compute the same arithmetic, and SpeCache's recall diagnostic (a counter that is
# only reported): every other knob KVQConfig reads changes what a dtype stores or reads or how many tokens it holds
# (the host tier's share, for specache). Other KVQ_ variables (a pinned budget: the evaluations fix their pool's
# tokens, and capacity rows at a pinned budget are not read; where models live) change no cell.
NEUTRAL_KNOBS = frozenset({"KVQ_ATTENTION_THREADS", "KVQ_CPU_KERNEL", "KVQ_SPECACHE_RECALL"})


def dtype_knobs() -> frozenset[str]:
    """The KVQ_ variables a run must leave unset for its numbers to describe a dtype at its defaults."""
    from sgl_kvq import config

    return frozenset(config.knob_names()) - NEUTRAL_KNOBS


# What `eval ppl` records as its text when it scores the embedded essays (its default)
DEFAULT_PPL_TEXT = "paul graham essays"

_ASSIGNMENT = re.compile(r"\b(KVQ_[A-Z0-9_]+)=")
_RECIPE_ENTRY = re.compile(r"kivimix:KVQ_RECIPE=[^,:\s]+")


@dataclass(frozen=True)
class Source:
    path: Path
    label: str  # the path as the table prints it: relative to the repository root where it lies under it
    kind: str
    data: dict
    time: float  # when measured (module doc), seconds since the epoch

    @property
    def order(self) -> tuple:
        """Sort key, newest last; the label breaks ties so the order never depends on the file system."""
        return self.time, self.label


def kind_of(data: object) -> str | None:
    if not isinstance(data, dict):
        return None
    if data.get("eval") in ("ppl", "agree", "niah"):
        return data["eval"]
    if "methods" in data and "capture_check" in data:
        return "attention"
    if "groups" in data and "kit_kl_threshold" in data:
        return "conformance"
    if isinstance(data.get("runs"), list) and "bench capacity" in str(data.get("command", "")):
        return "capacity"
    return None


def changed_knobs(data: dict) -> list[str]:
    """The KVQ_ knobs a run set that change what a dtype stores or reads: assignments in its recorded command, and
    the environment the writer recorded (`kvq_env`). A kivimix entry's recipe (`kivimix:KVQ_RECIPE=NAME`) names
    the dtype's row, not a knob."""
    command = _RECIPE_ENTRY.sub("kivimix", str(data.get("command", "")))
    names = set(_ASSIGNMENT.findall(command)) | set(data.get("kvq_env") or {})
    return sorted(names & dtype_knobs())


def changed_settings(kind: str, data: dict) -> list[str]:
    """`eval attention`'s page settings that differ from the served defaults (it takes them as arguments, not knobs),
    and an `eval ppl` over another text, or another length of it, than every other row's perplexity is over (the
    command's default: eval_ppl.TURNS x TURN_TOKENS)."""
    if kind == "ppl":
        from bench.commands.eval_ppl import TURN_TOKENS, TURNS

        ran = data.get("settings") or {}
        text = ran.get("text", DEFAULT_PPL_TEXT)
        out = [] if text == DEFAULT_PPL_TEXT else [f"text={text}"]
        if (ran.get("turns"), ran.get("turn_tokens")) != (TURNS, TURN_TOKENS):
            out.append(f"turns={ran.get('turns')} x {ran.get('turn_tokens')} tokens")
        return out
    if kind != "attention":
        return []
    from sgl_kvq.config import KVQConfig
    from sgl_kvq.formats.logquant import LogQuantParams

    served = {"group_size": KVQConfig.group_size, "value_group": KVQConfig.value_group,
              "residual": KVQConfig.residual, "window": LogQuantParams.window}
    ran = data.get("settings") or {}
    return [f"{k}={ran[k]}" for k, v in served.items() if k in ran and ran[k] != v]


def other_model(data: dict, model: TableModel) -> str | None:
    """The model a file measured where it is not `model`, else None. A file that does not record its model says it in
    its command's --model, where given (bench conformance's before it recorded it), else ran on every command's
    default (models.UNRECORDED)."""
    name = data.get("model")
    if name is None:
        given = re.search(r"--model[ =](\S+)", str(data.get("command", "")))
        name = given.group(1) if given else UNRECORDED
    return None if model.records(str(name)) else str(name)


def relative(path: Path, root: Path) -> str | None:
    """`path` relative to `root` (posix), or None where it lies outside."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return None


def label_of(path: Path, root: Path) -> str:
    return relative(path, root) or str(path)


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def commit_times(paths: list[Path], root: Path) -> dict[Path, float]:
    """Last-commit time of each path git tracks unchanged under `root` (the others are left out)."""
    inside = [p for p in paths if relative(p, root) is not None]
    if not inside or _git(root, "rev-parse", "--is-inside-work-tree") is None:
        return {}
    dirty = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *(label_of(p, root) for p in inside))
    if dirty is None:
        return {}
    changed = {line[3:].strip() for line in dirty.splitlines()}
    out = {}
    for p in inside:
        label = label_of(p, root)
        if label in changed:
            continue
        stamp = (_git(root, "log", "-1", "--format=%at", "--", label) or "").strip()
        if stamp:
            out[p] = float(stamp)
    return out


def shallow_history(root: Path) -> bool:
    """Whether `root`'s git history is cut short (a shallow clone): its files' last commits are then one commit, and
    which of two committed files is newer is not known (ties go by path)."""
    return (_git(root, "rev-parse", "--is-shallow-repository") or "").strip() == "true"


def measured_at(path: Path, data: dict, committed: dict[Path, float]) -> float:
    if data.get("finished_at"):
        return datetime.fromisoformat(str(data["finished_at"])).timestamp()
    return committed.get(path, path.stat().st_mtime)


def discover(results: Path) -> list[Path]:
    """Every JSON file under `results` (the committed ones: bench/results)."""
    return sorted(results.rglob("*.json"))


def load(paths: list[Path], root: Path, model: TableModel = SMOLLM2) -> tuple[list[Source], list[tuple[str, str]]]:
    """(the sources of a known kind that ran at the defaults on `model`, oldest first; (label, why) of those of a
    known kind that are not read)."""
    read = []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
        except (OSError, ValueError):
            continue
        kind = kind_of(data)
        if kind is not None:
            read.append((Path(p), kind, data))
    committed = commit_times([p for p, _, _ in read], root)
    sources, skipped = [], []
    for p, kind, data in read:
        label = label_of(p, root)
        knobs = changed_knobs(data)
        settings = changed_settings(kind, data)
        model_name = other_model(data, model)
        if knobs:
            skipped.append((label, f"sets {', '.join(knobs)}: not every knob at its default"))
        elif settings:
            skipped.append((label, f"runs with {', '.join(settings)}: not the served defaults"))
        elif model_name:
            skipped.append((label, f"another model ({model_name})"))
        else:
            sources.append(Source(p, label, kind, data, measured_at(p, data, committed)))
    return sorted(sources, key=lambda s: s.order), sorted(skipped)

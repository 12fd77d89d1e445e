"""The README is a front page: at most MAX_LINES lines of at most MAX_WIDTH characters and exactly two set-up
commands. The one knob table is docs/knobs.md's, which names exactly the KVQ_ knobs sgl_kvq reads (sgl_kvq/env.py and
the formats' declarations). Every relative link in README.md and docs/*.md, inline or reference-style, reaches a file
(and, for `#anchor` links into Markdown, a heading by GitHub's anchor rules)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
KNOBS_PAGE = ROOT / "docs" / "knobs.md"
MAX_LINES = 200
MAX_WIDTH = 120
SETUP_COMMANDS = ["make demo", "make test"]
KNOB = re.compile(r"^KVQ_[A-Z0-9_]+$")


def _sections(text: str) -> dict[str, str]:
    """`## ` heading -> the text under it (code fences respected)."""
    out, name, fenced = {}, None, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            name = line[3:].strip()
            out[name] = ""
            continue
        if name is not None:
            out[name] += line + "\n"
    return out


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def env_knobs() -> set[str]:
    """Every KVQ_ name sgl_kvq reads: the string constants of sgl_kvq/env.py's code (the module docstring aside)
    and the knobs the formats declare (sgl_kvq/formats/, Format.knobs), which KVQConfig reads with env.py's."""
    from sgl_kvq import config

    tree = ast.parse((ROOT / "sgl_kvq" / "env.py").read_text())
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and KNOB.match(node.value) and not (doc is not None and node is doc.value)} | set(config.knob_names())


def table_knobs(text: str) -> list[str]:
    """The first column of docs/knobs.md's knob table (the table whose header starts `| variable |`)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"^\|\s*variable\s*\|", line)]
    assert len(starts) == 1, f"docs/knobs.md has {len(starts)} knob tables (`| variable |` headers), not one"
    start = starts[0]
    knobs = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        knobs.append(line.split("|")[1].strip().strip("`"))
    return knobs


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (at most {MAX_LINES})"
    wide = [i + 1 for i, line in enumerate(lines) if len(line) > MAX_WIDTH]
    assert not wide, f"README.md lines {wide} are over {MAX_WIDTH} characters"


def test_install_has_exactly_the_two_setup_commands():
    install = _sections(README.read_text())["Install"]
    commands = [line.split("#")[0].strip() for block in _code_blocks(install) for line in block.splitlines()]
    commands = [c for c in commands if c]
    assert commands == SETUP_COMMANDS, f"the Install section's commands are {commands}, not {SETUP_COMMANDS}"


def test_one_knob_table_and_it_is_env_py():
    text = KNOBS_PAGE.read_text()
    rows = table_knobs(text)
    assert len(rows) == len(set(rows)), f"a knob has two rows: {sorted(r for r in rows if rows.count(r) > 1)}"
    knobs = env_knobs()
    assert knobs, "no KVQ_ names found in sgl_kvq/env.py"
    assert not set(rows) - knobs, \
        f"docs/knobs.md rows for knobs sgl_kvq/env.py does not read: {sorted(set(rows) - knobs)}"
    assert not knobs - set(rows), f"knobs sgl_kvq/env.py reads without a docs/knobs.md row: {sorted(knobs - set(rows))}"
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        if doc == KNOBS_PAGE:
            continue
        assert not re.search(r"^\|\s*variable\s*\|", doc.read_text(), flags=re.M), \
            f"{doc.relative_to(ROOT)} has a knob table: the one knob table is docs/knobs.md's"


def test_env_knobs_finds_what_env_py_reads():
    """The parser sees the knobs as env.py and the formats declare them (CORE_KNOBS, Format.knobs, os.environ.get
    names)."""
    from sgl_kvq import env
    from sgl_kvq.formats import registry

    for var in [*env.CORE_KNOBS, *registry.KNOBS]:
        assert var in env_knobs()
    assert {"KVQ_GEAR_RANK", "KVQ_TOPK", "KVQ_ZIPCACHE_SALIENT", "KVQ_LOGQUANT_WINDOW"} <= set(registry.KNOBS)
    assert {"KVQ_KV_CACHE_GB", "KVQ_HOST_MEM_FRACTION", "KVQ_SPECACHE_RECALL", "KVQ_CACHE_DIR"} <= env_knobs()
    # names only the docstring mentions (set by sgl_kvq itself) are not knobs
    assert "KVQ_AUTO_THREADS_BIND" not in env_knobs()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation but hyphens and underscores removed, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # links in code blocks are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    inline = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return inline + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, flags=re.M)  # reference-style definitions


def test_slug_follows_github():
    assert slug("Main job (`make demo`)") == "main-job-make-demo"
    assert slug("What SpeCache's 16-bit extends cost") == "what-specaches-16-bit-extends-cost"
    assert slug("GEAR, LogQuant and ZipCache") == "gear-logquant-and-zipcache"
    assert slug("Past one rank: tensor and data parallel") == "past-one-rank-tensor-and-data-parallel"


def test_relative_links_reach_files_and_headings():
    docs = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for doc in docs:
        for target in _links(doc):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / unquote(path)).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)

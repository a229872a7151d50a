"""Every document the code and the docs cite exists, and so does every section they cite.

A citation is a ``name.md`` path in a Python file (docstrings and comments alike), a Markdown file, the
Makefile or a notebook: a bare name (``engine.md``) means ``docs/engine.md``, a path (``docs/x.md``,
``custom_calls/README.md``) is relative to the repository root. Section numbers after it (``engine.md §1.3``,
``model.md §4.8 and §5``, ``engine.md §3-§4``) must be numbered headings of that file (``## 1. KV cache``,
``### 1.3 Hit rule``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FILES = sorted({*ROOT.glob("deepinfer_jax/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/**/*.py"),
                *ROOT.glob("examples/**/*.py"), *ROOT.glob("examples/**/*.ipynb"), *DOCS.glob("*.md"),
                *ROOT.glob("*.md"), *ROOT.glob("custom_calls/**/*.md"), *ROOT.glob("checkpoints/*/README.md"),
                ROOT / "Makefile"} - {Path(__file__).resolve()})
CITE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.md)\b((?:\s*(?:§\s*\d+(?:\.\d+)*|[-–,]|and|or))*)")
#: Names that are not citations of ours: files other projects ship, and files a script writes.
NOT_OURS = {
    ("docs/recipe.md", "README.zh.md"): "deepseek-recipe's own files, listed as its layout",
    ("docs/recipe.md", "docs/streaming.md"): "deepseek-recipe's own files, listed as its layout",
    ("docs/recipe.md", "docs/development.md"): "deepseek-recipe's own files, listed as its layout",
    ("docs/model.md", "deepseek_v41_runtime.md"): "a page of ROCm ATOM's, listed among the sources",
    ("examples/replay_study.py", "replay_study.md"): "the report the study writes",
}


def _target(name: str, cited_in: Path) -> Path:
    """A bare name is a page of docs/; a path is relative to the root, else to the citing file's directory."""
    if "/" not in name and name != "README.md":
        return DOCS / name
    return ROOT / name if (ROOT / name).exists() else cited_in.parent / name


def _sections(path: Path) -> set[str]:
    found = set()
    for line in path.read_text().splitlines():
        m = re.match(r"#+\s+(\d+(?:\.\d+)*)\.?\s", line)
        if m:
            found.add(m.group(1))
    return found


def _citations():
    for path in FILES:
        rel = str(path.relative_to(ROOT))
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            for m in CITE.finditer(line):
                name = m.group(1)
                if (rel, name) in NOT_OURS or name.startswith(("http", "www.")):
                    continue
                yield rel, line_no, name, _target(name, path), re.findall(r"§\s*(\d+(?:\.\d+)*)", m.group(2))


CITATIONS = list(_citations())


def test_citations_are_found():
    names = {name for _, _, name, _, _ in CITATIONS}
    assert {"engine.md", "model.md", "recipe.md", "architecture.md"} <= names
    assert any(secs for *_, secs in CITATIONS)


def test_every_cited_document_exists():
    missing = sorted({f"{rel}:{n}: {name}" for rel, n, name, target, _ in CITATIONS if not target.is_file()})
    assert not missing, "cited documents that do not exist:\n" + "\n".join(missing)


def test_every_cited_section_is_a_heading():
    bad = []
    for rel, n, name, target, secs in CITATIONS:
        if not secs or not target.is_file():
            continue
        have = _sections(target)
        bad += [f"{rel}:{n}: {name} §{s}" for s in secs if s.rstrip(".") not in have]
    assert not bad, "cited sections without a heading:\n" + "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("key", sorted(NOT_OURS))
def test_exceptions_are_still_needed(key):
    rel, name = key
    assert name in (ROOT / rel).read_text(), f"remove {key} from NOT_OURS"

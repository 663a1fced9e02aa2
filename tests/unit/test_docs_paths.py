"""The docs name only files and folders that exist: every `folder/...` path in backticks in README.md and docs/*.md,
and every box of docs/architecture.svg's source (hack/diagram.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = "operator|server|kernels|hack|metronome|crds|charts|docs|tests|examples|images|\\.ci"
PATH = re.compile(rf"`((?:{TOP})/[\w./-]*)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_backticked_paths_exist(doc):
    missing = sorted({p.rstrip(".") for p in PATH.findall(doc.read_text()) if not (ROOT / p.rstrip(".")).exists()})
    assert missing == [], f"{doc.name} names paths that do not exist"


def test_the_diagram_names_real_paths():
    source = (ROOT / "hack" / "diagram.py").read_text()
    named = re.findall(rf'"((?:{TOP})/[\w./-]*)"', source)
    assert len(named) >= 10
    assert [p for p in named if not (ROOT / p).exists()] == []

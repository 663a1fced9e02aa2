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


MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a document's headings (lower case, punctuation but hyphens and underscores dropped,
    spaces as hyphens, a repeated heading numbered -1, -2, ...) and its explicit `<a id="...">` anchors."""
    text = FENCE.sub("", text)
    anchors: set[str] = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    for line in text.splitlines():
        if not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "")).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def test_heading_anchors_follow_githubs_rule():
    text = ("# Where a step's time goes\n## 2026-12-04, 12:36 UTC: `--mixed-overlap` on\n## Where a step's time goes\n"
            '- <a id="per-client-rate"></a>**Per-client rate**\n```sh\n# not a heading\n```\n')
    assert heading_anchors(text) == {"where-a-steps-time-goes", "2026-12-04-1236-utc---mixed-overlap-on",
                                     "where-a-steps-time-goes-1", "per-client-rate"}


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_files_and_headings(doc):
    """Every relative link of a Markdown page names a file that exists and, with #anchor, a heading in it."""
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            broken.append(target)
    assert broken == [], f"{doc.relative_to(ROOT)} links to missing files or headings"

"""Run a metronome command with some of its modules taken from another directory: an A/B of two versions of a
kernel (or any module) within one process per run, on one machine, in one device call.

    mkdir -p old/kernels
    git show 0402880:kernels/triton_fp8.py > old/kernels/triton_fp8.py
    git show 0402880:kernels/triton_fused.py > old/kernels/triton_fused.py
    python3 -m hack.with_modules old bench engine --sections device,saturation ...   # the old quantising kernels
    python3 -m metronome.cli bench engine --sections device,saturation ...           # the working tree's

A file DIR/<path>.py stands for the module metronome.<path with dots>: it is imported in place of the tree's
(relative imports inside it resolve against the tree's package, so it must fit the rest of the tree). Whole runs
of the same code differ by a few per cent with their place in a call (docs/perf/fp8-h200.md): alternate the
versions, in both orders.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

PACKAGE = "metronome"


class ModulesFrom(importlib.abc.MetaPathFinder):
    """Finds metronome.<a>.<b> as DIR/<a>/<b>.py where that file exists."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.replaced = sorted(f"{PACKAGE}." + ".".join(p.relative_to(directory).with_suffix("").parts)
                               for p in directory.rglob("*.py"))

    def find_spec(self, name, path=None, target=None):
        if name not in self.replaced:
            return None
        return importlib.util.spec_from_file_location(name, self.directory / (name.split(".", 1)[1].replace(".", "/")
                                                                              + ".py"))


def install(directory: str | Path) -> ModulesFrom:
    """Put the finder first on sys.meta_path (before anything imports the modules it replaces)."""
    finder = ModulesFrom(Path(directory).resolve())
    if not finder.replaced:
        raise SystemExit(f"with_modules: no .py files under {directory}")
    already = [name for name in finder.replaced if name in sys.modules]
    if already:
        raise SystemExit(f"with_modules: already imported, cannot be replaced: {', '.join(already)}")
    sys.meta_path.insert(0, finder)
    return finder


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    finder = install(argv[0])
    print(f"with_modules: {', '.join(finder.replaced)} from {finder.directory}", flush=True)
    from metronome.cli import main as metronome_main

    return metronome_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

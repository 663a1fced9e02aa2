"""hack/with_modules.py: a metronome module imported from another directory in place of the tree's, in a fresh
interpreter (replacing a module is for a whole process)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_a_replaced_module_comes_from_the_directory_and_its_relative_imports_from_the_tree(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "fp8_tiles.py").write_text(textwrap.dedent("""
        from .metadata import AttentionMetadata  # the tree's module, through the package
        LARGE_ROWS = 5
        def matmul_tiles(m):
            return (m, AttentionMetadata.__name__)
    """))
    done = _run(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("with_modules", "hack/with_modules.py")
        with_modules = importlib.util.module_from_spec(spec); spec.loader.exec_module(with_modules)
        finder = with_modules.install({str(tmp_path)!r})
        print(finder.replaced)
        from metronome.kernels import fp8_tiles, metadata
        print(fp8_tiles.LARGE_ROWS, fp8_tiles.matmul_tiles(3), fp8_tiles.__file__)
        print(metadata.__file__)
    """)
    assert done.returncode == 0, done.stderr
    replaced, tiles, tree = done.stdout.splitlines()
    assert replaced == "['metronome.kernels.fp8_tiles']"
    assert tiles == f"5 (3, 'AttentionMetadata') {tmp_path / 'kernels' / 'fp8_tiles.py'}"
    assert tree.endswith("kernels/metadata.py") and str(tmp_path) not in tree


def test_an_empty_directory_or_an_already_imported_module_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "late" / "kernels").mkdir(parents=True)
    (tmp_path / "late" / "kernels" / "fp8_tiles.py").write_text("LARGE_ROWS = 5\n")
    done = _run(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("with_modules", "hack/with_modules.py")
        with_modules = importlib.util.module_from_spec(spec); spec.loader.exec_module(with_modules)
        for directory in ({str(tmp_path / 'empty')!r}, {str(tmp_path / 'late')!r}):
            try:
                if directory.endswith("late"):
                    import metronome.kernels.fp8_tiles
                with_modules.install(directory)
            except SystemExit as exc:
                print(exc)
    """)
    assert done.returncode == 0, done.stderr
    empty, late = done.stdout.splitlines()
    assert empty.startswith("with_modules: no .py files under")
    assert late == "with_modules: already imported, cannot be replaced: metronome.kernels.fp8_tiles"

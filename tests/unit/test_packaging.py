"""The package layout's promises: three code folders as sub-packages, a light CLI, no top-level `operator`."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

from metronome.cli import SUBCOMMANDS

VENV_BIN = Path(sys.executable).parent


def test_operator_name_stays_the_standard_library_module():
    probe = "import operator, metronome.operator; print(operator.__file__); print(metronome.operator.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd="/")
    stdlib_file, ours = out.stdout.split()
    assert Path(stdlib_file).parent == Path(sysconfig.get_paths()["stdlib"])
    assert Path(ours).parent.name == "operator"


def test_help_lists_every_subcommand_without_importing_torch():
    probe = ("import sys; from metronome.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('torch', 'kopf', 'kubernetes', 'fastapi', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"the CLI parser imported heavy modules: {out.stdout}"
    help_text = subprocess.run([str(VENV_BIN / "metronome"), "--help"],
                               capture_output=True, text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert name in help_text


def test_unknown_subcommand_is_a_usage_error_naming_it():
    result = subprocess.run([str(VENV_BIN / "metronome"), "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "frobnicate" in result.stderr


def test_operator_imports_only_the_contract_never_the_server():
    """The operator's side of the wall: every module under operator/ loads without metronome.server or torch."""
    modules = _operator_modules()
    probe = ("import importlib, sys\n"
             f"for name in {modules!r}: importlib.import_module(name)\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('metronome.server')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"the operator reached into the server: {out.stdout}"


def _operator_modules(sub: str = "") -> list[str]:
    """Every module under operator/ (or its folder `sub`), as `metronome.operator...` names."""
    root = Path(__file__).resolve().parents[2] / "operator"
    return sorted("metronome.operator." + ".".join(p.relative_to(root).with_suffix("").parts)
                  for p in (root / sub).rglob("*.py") if p.stem not in ("__init__", "__main__"))


def test_the_tuner_is_pure():
    """operator/tuning/ loads no kopf, no Kubernetes or HTTP client, and none of the operator's API glue: the
    operator modules it reaches are its own, the spec error and the Event vocabulary."""
    modules = _operator_modules("tuning")
    assert "metronome.operator.tuning.controller" in modules
    probe = ("import importlib, sys\n"
             f"for name in {modules!r}: importlib.import_module(name)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes', 'urllib3', 'requests',"
             " 'prometheus_api_client', 'torch')))\n"
             "print(sorted(m for m in sys.modules if m.startswith('metronome.operator.')"
             " and not m.startswith('metronome.operator.tuning')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd="/")
    heavy, glue = out.stdout.strip().splitlines()
    assert heavy == "[]", f"the tuner loaded I/O libraries: {heavy}"
    assert glue == "['metronome.operator.changes', 'metronome.operator.spec_error']", glue


def test_a_checkout_imports_from_its_root_without_an_install():
    """What the GPU machine does: no install, the repository root on sys.path after start-up (as `python -m` puts it),
    no -P. `-S` keeps site-packages (and the editable install's finder) out, so only metronome/__init__.py's mapping
    can find the code folders; the standard library's `operator` is loaded first, as `site` does at start-up."""
    root = Path(__file__).resolve().parents[2]
    probe = ("import importlib.util, operator, sys; "
             f"sys.path.insert(0, {str(root)!r}); import metronome; print(metronome.__file__); "
             "print(*(importlib.util.find_spec(f'metronome.{m}').origin for m in ('server', 'kernels', 'operator')))")
    out = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, check=True, cwd="/")
    package, folders = out.stdout.strip().splitlines()
    assert Path(package) == root / "metronome" / "__init__.py"
    assert [Path(f) for f in folders.split()] == [root / m / "__init__.py" for m in ("server", "kernels", "operator")]


def test_the_test_support_is_a_distribution_of_its_own():
    """tests/support installs as `metronome-testing`, so the product's wheel (and the images built from it) carries
    no test code; tests and hack/ scripts import it by name, with no sys.path edits."""
    root = Path(__file__).resolve().parents[2]
    probe = ("import importlib.metadata as md, metronome_testing; print(metronome_testing.__file__); "
             "print(md.distribution('metronome').read_text('top_level.txt').split()); "
             "print(md.distribution('metronome-testing').read_text('top_level.txt').split())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd="/")
    location, product, support = out.stdout.strip().splitlines()
    assert Path(location) == root / "tests" / "support" / "metronome_testing" / "__init__.py"
    assert product == "['metronome']" and support == "['metronome_testing']"

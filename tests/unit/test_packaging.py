"""The package layout promises of DESIGN §1: three code folders as sub-packages, a light CLI, no top-level `operator`."""
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
    help_text = subprocess.run([str(VENV_BIN / "metronome"), "--help"], capture_output=True, text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert name in help_text


def test_unknown_subcommand_is_a_usage_error_naming_it():
    result = subprocess.run([str(VENV_BIN / "metronome"), "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "frobnicate" in result.stderr

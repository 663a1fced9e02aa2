"""Where the checkout's files are. The test support runs from a source checkout only (an editable install, or
tests/support on PYTHONPATH on the GPU machine), so they are found relative to this file."""
from __future__ import annotations

from pathlib import Path

from metronome.operator.spec import GROUP, PLURAL

ROOT = Path(__file__).resolve().parents[3]
HACK = ROOT / "hack"
CHART = ROOT / "charts" / "metronome"
CRD_FILE = ROOT / "crds" / "inferenceservice.yaml"
EXAMPLE = ROOT / "examples" / "inferenceservice.yaml"
CRD_NAME = f"{PLURAL}.{GROUP}"

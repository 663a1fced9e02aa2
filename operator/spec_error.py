"""SpecError: an InferenceService body the operator cannot act on. A module of its own so that the CR model
(spec.py) and the tuner (tuning/), which checks spec.autotune, raise the one error without importing each other."""
from __future__ import annotations

from metronome.contract.errors import MetronomeError


class SpecError(MetronomeError, ValueError):
    """An InferenceService body the operator cannot act on; the message names the field."""

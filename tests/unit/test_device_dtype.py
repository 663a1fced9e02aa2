"""dtype "auto" by the GPU's compute capability: bfloat16 only where the hardware has it (8.0, Ampere, on)."""
from __future__ import annotations

import pytest
import torch

from metronome.server.models import device as device_mod
from metronome.server.models.loader import resolve_dtype


@pytest.mark.parametrize(("capability", "expected"), [
    ((7, 0), torch.float16),   # V100
    ((7, 5), torch.float16),   # T4
    ((8, 0), torch.bfloat16),  # A100
    ((8, 6), torch.bfloat16),  # A10G, RTX 30xx
    ((9, 0), torch.bfloat16),  # H100, H200
])
def test_auto_follows_the_compute_capability(monkeypatch, capability, expected):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: asked.append(dev) or capability)
    gpu = torch.device("cuda", 1)
    assert resolve_dtype("auto", gpu) == expected
    assert asked == [gpu]  # the capability of the device the model goes to, not of GPU 0


def test_auto_is_float32_on_cpu_and_explicit_dtypes_are_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: pytest.fail("no GPU on CPU"))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 5))
    assert resolve_dtype("bfloat16", torch.device("cuda")) == torch.bfloat16  # asked for: not second-guessed
    assert device_mod.BF16_MIN_CAPABILITY == (8, 0)

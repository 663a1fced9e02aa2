"""The one place a device name becomes a torch.device, and dtype "auto" a torch.dtype for that device."""
from __future__ import annotations

import torch

from metronome.contract.errors import InvalidRequestError


def resolve_device(device: str | torch.device, check_available: bool = True) -> torch.device:
    """'auto' -> cuda when one is visible, else cpu; otherwise cpu, cuda or cuda:N. `check_available`: a CUDA
    device must be visible (off for a caller that counts the GPUs itself and says how many it needs)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"unknown device {device!r}; use auto, cpu or cuda[:N]", param="device")
    if check_available and resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device cuda requested but no CUDA device is available", param="device")
    return resolved


# bfloat16 needs compute capability 8.0 (Ampere) or newer; T4 (7.5) and V100 (7.0) emulate it slowly or not at all.
BF16_MIN_CAPABILITY = (8, 0)


def auto_dtype(device: torch.device) -> torch.dtype:
    """dtype "auto": bfloat16 on GPUs with native bf16, float16 on older ones, float32 on CPU."""
    if device.type != "cuda":
        return torch.float32
    capability = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if tuple(capability) >= BF16_MIN_CAPABILITY else torch.float16

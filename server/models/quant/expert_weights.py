"""The routed experts of an FP8 mixture-of-experts checkpoint, dequantised as they load.

Qwen3-30B-A3B-FP8 (128 x 128 blocks), llm-compressor's FP8-dynamic MoE exports (per channel) and AutoFP8's
Mixtral (per tensor) store every `experts.N.{gate,up,down}_proj.weight` (or Mixtral's `w1/w2/w3`) as e4m3 with
its `weight_scale` / `weight_scale_inv`. Here each expert weight is multiplied by its scale when both have arrived
and handed on in float32 to the MoE block's own loader, which stores it in the model dtype: the experts then run
with FP8-rounded weights on unquantised activations (W8A16, the way vLLM runs FP8 MoE checkpoints on GPUs
without FP8 MoE kernels), on every MoE backend, while attention, dense MLPs and shared experts stay FP8 W8A8.
The price is memory: the experts take the model dtype's bytes, twice the checkpoint's. A static `input_scale` of
an expert has nothing to scale and is dropped.
"""
from __future__ import annotations

import re

import torch

from metronome.server.models.quant import fp8
from metronome.server.models.quant.scheme import Fp8Scheme

_EXPERT_TENSOR = re.compile(r"(?P<module>.+\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3))\."
                            r"(?P<kind>weight|weight_scale|weight_scale_inv|input_scale|activation_scale)")


class ExpertDequantizer:
    """Pairs each FP8 expert weight with its scale, in whichever order the checkpoint files hold them."""

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """None when `name` is not an FP8 expert's tensor (the caller routes it as usual); else the tensors now
        ready for the model's loader (none while a weight waits for its scale or a scale for its weight)."""
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            return None
        module, kind = match["module"], match["kind"]
        if kind == "weight" and tensor.dtype != fp8.FP8_DTYPE and module not in self.pending:
            return None  # an expert the checkpoint left in its float dtype
        if kind in ("input_scale", "activation_scale"):
            return []
        parts = self.pending.setdefault(module, {})
        part = "weight" if kind == "weight" else "scale"
        if part in parts:
            raise ValueError(f"checkpoint tensor {name!r}: {module} has two {part}s")
        parts[part] = tensor
        if len(parts) < 2:
            return []
        del self.pending[module]
        try:
            return [(f"{module}.weight", self._dequantize(parts["weight"], parts["scale"]))]
        except ValueError as error:
            raise ValueError(f"checkpoint tensors of {module!r}: {error}") from None

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if q.dtype != fp8.FP8_DTYPE or q.dim() != 2:
            raise ValueError(f"a scaled expert weight must be a 2-d float8_e4m3fn matrix, got {q.dtype} "
                             f"{tuple(q.shape)}")
        rows, cols = q.shape
        scale = scale.float()
        if self.scheme.weights == "block":
            grid = (-(-rows // self.scheme.block[0]), -(-cols // self.scheme.block[1]))
            if tuple(scale.shape) != grid:
                raise ValueError(f"block scales of shape {tuple(scale.shape)} for a {rows} x {cols} weight in "
                                 f"{self.scheme.block[0]} x {self.scheme.block[1]} blocks (expected {grid})")
            return fp8.dequantize(q, fp8.expand_blocks(scale, (rows, cols), self.scheme.block))
        if scale.numel() == 1:
            return fp8.dequantize(q, scale.reshape(()))
        if scale.numel() == rows:
            return fp8.dequantize(q, scale.reshape(rows, 1))
        raise ValueError(f"a scale of shape {tuple(scale.shape)} fits neither the whole {rows} x {cols} weight "
                         "nor its rows")

    def finish(self) -> None:
        if self.pending:
            module, parts = next(iter(self.pending.items()))
            missing = "scale" if "weight" in parts else "FP8 weight"
            raise ValueError(f"the checkpoint has no {missing} for {module!r} ({len(self.pending)} experts "
                             "incomplete)")

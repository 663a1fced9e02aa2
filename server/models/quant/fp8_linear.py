"""`Fp8Linear`: a linear layer whose weight is stored in FP8 e4m3 with its scales, and whose input is quantised
to FP8 (dynamically per token / per group, or with a static per-tensor scale) before the GEMM.

A layer may be a fusion of several checkpoint tensors (q, k, v → qkv_proj; gate, up → gate_up_proj), each a
*shard* of rows with its own scales in the checkpoint. Loading fills shards one by one (`load`); `finalize` then
brings the scales into the form the GEMM takes:
- per-tensor weight scales of a fused layer are spread over their shards' rows: the layer becomes per-channel,
  with every value exactly as the checkpoint has it. vLLM instead requantises the shards to their largest scale
  (requantize_with_max_scale) so that a static-activation layer keeps one scale per operand; on a tiny Llama
  made by compressed-tensors (FP8 static scheme) that second rounding moved the logits by 0.068 where the whole
  FP8 error against the bf16 model was 0.055, while per-shard scales give transformers' logits bit for bit
  (tests/unit/test_fp8_ecosystem.py). The price is a column-scale epilogue in the fused layers' GEMM;
- a single-shard per-tensor layer keeps one 0-d scale (with a static input scale: the plain per-tensor GEMM);
- per-channel ([N]) and block scales ([N, ceil(K / bk)]: each row carries its block's scales, so fused shards
  whose sizes are not multiples of the block height still line up) stay as they are;
- a static input scale is one value per layer: the largest of the shards' (they read the same input, so a
  calibration gives them the same amax anyway).

Forward: on CUDA the GEMM of quant/cuda_gemm.py; elsewhere `emulated_linear`, the exact FP8 math in float32
(dequantised weight times dequantised activation), which is also the reference the CUDA path is tested against.
"""
from __future__ import annotations

import torch
from torch import nn

from metronome.server.models.quant import fp8
from metronome.server.models.quant.activation import ActivationQuant, Fp8Activation, quantize_activation
from metronome.server.models.quant.scheme import Fp8Scheme

LOAD_KINDS = ("weight", "weight_scale", "input_scale", "input_scale_ub")


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, scheme: Fp8Scheme,
                 shard_sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None,
                 checkpoint_names: tuple[str, ...] = ()):
        super().__init__()
        if sum(shard_sizes) != out_features or min(shard_sizes) < 1:
            raise ValueError(f"shard sizes {shard_sizes} do not add up to {out_features} output features")
        self.in_features, self.out_features = in_features, out_features
        self.shard_sizes = tuple(shard_sizes)
        self.checkpoint_names = checkpoint_names  # the checkpoint modules of the shards, in order
        self.granularity = scheme.weights  # "tensor" | "channel" | "block"; "tensor" may become "channel"
        self.block = scheme.block
        self.static = scheme.activations == "static"
        self.activation_group = scheme.activation_group
        self.amax_ub = scheme.activation_ub
        self.quantize_on_load = not scheme.prequantized  # bf16 weights in, per-channel FP8 kept
        self.out_dtype = dtype
        self.register_buffer("weight", torch.empty((out_features, in_features), dtype=fp8.FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.empty(self._loading_scale_shape(), dtype=torch.float32,
                                                         device=device))
        self.register_buffer("input_scale", torch.empty(len(shard_sizes), dtype=torch.float32, device=device)
                             if self.static else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        # final after finalize()
        self.activation_quant = ActivationQuant(group=self.activation_group, amax_ub=self.amax_ub)
        self.gemm = "auto"  # CUDA GEMM choice (cuda_gemm.GEMMS), given to finalize
        self.unit_scale: torch.Tensor | None = None
        self.column_scale: torch.Tensor | None = None
        self._loaded: set[tuple[str, int]] = set()

    def _loading_scale_shape(self) -> tuple[int, ...]:
        if self.granularity == "tensor":
            return (len(self.shard_sizes),)
        if self.granularity == "channel":
            return (self.out_features,)
        return (self.out_features, -(-self.in_features // self.block[1]))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights=fp8 per-{self.granularity}, activations="
                f"{'static' if self.static else 'per-token' if self.activation_group is None else 'per-group'}")

    # ---- loading ------------------------------------------------------------------------------------------

    def _rows(self, shard: int | None) -> tuple[int, int]:
        if shard is None:
            return 0, self.out_features
        start = sum(self.shard_sizes[:shard])
        return start, start + self.shard_sizes[shard]

    def load(self, kind: str, shard: int | None, tensor: torch.Tensor) -> None:
        """One checkpoint tensor of shard `shard` (None: the whole fused matrix): its FP8 `weight` (or a float
        weight when quantising on load), its `weight_scale`, its `input_scale`, or the activation bound an FBGEMM
        export may store beside them (`input_scale_ub`, checked against the config's). ValueError if it does not
        fit."""
        if kind not in LOAD_KINDS:
            raise ValueError(f"unknown FP8 tensor kind {kind!r}")
        start, stop = self._rows(shard)
        shards = range(len(self.shard_sizes)) if shard is None else (shard,)
        with torch.no_grad():
            if kind == "weight":
                self._load_weight(tensor, start, stop, shards)
            elif kind == "weight_scale":
                self._load_weight_scale(tensor, start, stop, shards)
            elif kind == "input_scale_ub":
                self._check_amax_ub(tensor)
                return
            elif self.static:
                if tensor.numel() != 1:
                    raise ValueError(f"input_scale must be one value (per-tensor static), got shape "
                                     f"{tuple(tensor.shape)}")
                self.input_scale[list(shards)] = tensor.float().reshape(()).to(self.input_scale.device)
            # a dynamic layer ignores a calibrated input_scale: its activations get their own scales
        self._loaded.update((kind, s) for s in shards)

    def _check_amax_ub(self, tensor: torch.Tensor) -> None:
        stored = tensor.float().flatten()
        if self.amax_ub is None or stored.numel() != 1 or not torch.allclose(
                stored, torch.tensor([self.amax_ub]), rtol=1e-6, atol=0):
            raise ValueError(f"({stored.tolist()}) differs from quantization_config.activation_scale_ub "
                             f"({self.amax_ub})")

    def _load_weight(self, tensor: torch.Tensor, start: int, stop: int, shards) -> None:
        expected = (stop - start, self.in_features)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {expected}")
        if tensor.dtype == fp8.FP8_DTYPE:
            self.weight[start:stop].copy_(tensor)
        elif self.quantize_on_load and tensor.is_floating_point():
            q, scale = fp8.quantize_per_channel(tensor.to(self.weight.device))
            self.weight[start:stop].copy_(q)
            self.weight_scale[start:stop].copy_(scale)
            self._loaded.update(("weight_scale", s) for s in shards)
        else:
            raise ValueError(f"is {tensor.dtype}, expected float8_e4m3fn: the checkpoint's quantization_config "
                             "quantises this layer")

    def _load_weight_scale(self, tensor: torch.Tensor, start: int, stop: int, shards) -> None:
        scale = tensor.float().to(self.weight_scale.device)
        rows = stop - start
        if self.granularity == "tensor":
            if scale.numel() != 1:
                raise ValueError(f"a per-tensor weight scale must be one value, got shape {tuple(tensor.shape)}")
            self.weight_scale[list(shards)] = scale.reshape(())
        elif self.granularity == "channel":
            if scale.numel() != rows or scale.dim() > 2 or scale.dim() == 2 and scale.shape[1] != 1:
                raise ValueError(f"a per-channel weight scale must be [{rows}, 1] or [{rows}], got "
                                 f"{tuple(tensor.shape)}")
            self.weight_scale[start:stop].copy_(scale.reshape(rows))
        else:
            bn, bk = self.block
            grid = (-(-rows // bn), -(-self.in_features // bk))
            if tuple(scale.shape) != grid:
                raise ValueError(f"block scales of a [{rows}, {self.in_features}] weight in {bn}x{bk} blocks must "
                                 f"be {list(grid)}, got {list(tensor.shape)}")
            self.weight_scale[start:stop].copy_(scale.repeat_interleave(bn, dim=0)[:rows])

    def missing(self) -> list[str]:
        """What loading has not filled yet, as 'weight_scale of q_proj'-style names."""
        kinds = ("weight", "weight_scale") + (("input_scale",) if self.static else ())
        names = self.checkpoint_names or tuple(f"shard {i}" for i in range(len(self.shard_sizes)))
        return [f"{kind} of {names[shard]}" for shard in range(len(self.shard_sizes)) for kind in kinds
                if (kind, shard) not in self._loaded]

    def finalize(self, gemm: str = "auto") -> None:
        """After every shard is loaded: scales into their serving form (see the module doc)."""
        missing = self.missing()
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} FP8 tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            if self.granularity == "tensor" and len(self.shard_sizes) > 1:
                self.weight_scale = torch.repeat_interleave(
                    self.weight_scale, torch.tensor(self.shard_sizes, device=self.weight_scale.device))
                self.granularity = "channel"
            elif self.granularity == "tensor":
                self.weight_scale = self.weight_scale.reshape(())
            if self.static:
                self.input_scale = self.input_scale.max().reshape(())
        self.activation_quant = ActivationQuant(group=self.activation_group,
                                                static_scale=self.input_scale if self.static else None,
                                                amax_ub=self.amax_ub)
        self.gemm = gemm
        # what the CUDA GEMMs read besides the buffers: a unit scale and the weight scales as one [1, N] row
        self.unit_scale = torch.ones((), dtype=torch.float32, device=self.weight.device)
        if self.granularity != "block":
            self.column_scale = self.weight_scale.expand(self.out_features).reshape(1, -1).contiguous()

    @classmethod
    def from_float(cls, linear: nn.Linear, scheme: Fp8Scheme, shard_sizes: tuple[int, ...] | None = None
                   ) -> Fp8Linear:
        """Quantise a float linear layer now (per-channel weights, the on-the-fly scheme)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, scheme=scheme,
                    shard_sizes=shard_sizes or (linear.out_features,), dtype=linear.weight.dtype,
                    device=linear.weight.device)
        layer.load("weight", None, linear.weight.detach())
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        layer.finalize()
        return layer

    # ---- math ---------------------------------------------------------------------------------------------

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [N, K]: the weight this layer multiplies by."""
        scale = self.weight_scale
        if self.granularity == "block":
            scale = fp8.expand_groups(scale, self.in_features, self.block[1])
        elif scale.dim() == 1:
            scale = scale[:, None]
        return fp8.dequantize(self.weight, scale)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """x [..., K] in the model dtype, or an activation already quantised by the kernel that produced it."""
        if isinstance(x, Fp8Activation):
            act, lead = x, x.q.shape[:-1]
        else:
            lead = x.shape[:-1]
            act = quantize_activation(x.reshape(-1, self.in_features), self.activation_quant)
        if act.q.device.type == "cuda":
            from metronome.server.models.quant.cuda_gemm import fp8_gemm
            out = fp8_gemm(act, self)
        else:
            out = emulated_linear(act, self)
        return out.reshape(*lead, self.out_features)


def emulated_linear(act: Fp8Activation, layer: Fp8Linear) -> torch.Tensor:
    """The FP8 GEMM's math in float32: dequantised activation @ dequantised weight^T (+ bias), cast to the model
    dtype once at the end, as the scaled GEMMs do."""
    out = act.dequantize() @ layer.dequantized_weight().t()
    if layer.bias is not None:
        out = out + layer.bias.float()
    return out.to(act.dtype)

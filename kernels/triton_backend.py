"""The `triton` backend: the Triton KV-write and mixed-batch paged attention kernels behind the backend protocol."""
from __future__ import annotations

import torch

from .checks import check_attention_inputs, check_write_kv_inputs
from .metadata import AttentionMetadata
from .triton_attention import paged_attention
from .triton_kv_write import write_kv_triton


class TritonBackend:
    name = "triton"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        check_write_kv_inputs(key, value, k_cache, v_cache, slot_mapping)
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        check_attention_inputs(q, k_cache, v_cache, meta)
        return paged_attention(q, k_cache, v_cache, meta, scale)

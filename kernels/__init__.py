"""Attention and KV-write kernels over the paged KV cache, behind one backend protocol.

Backends: `torch` (exact reference; the CPU path), `triton` (default on CUDA: one launch per mixed batch, any block
size, GQA, split-K for long decodes), `flash_attn` (only where the package imports and block_size % 256 == 0).

    backend = get_backend(select_backend(device, block_size, head_dim, requested="auto"))
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = backend.attention(q, k_cache, v_cache, meta, scale)
"""
from .backend import AttentionBackend, available_backends, get_backend, select_backend
from .metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_backend", "select_backend"]

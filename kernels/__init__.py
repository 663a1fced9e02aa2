"""Attention and KV-write kernels over the paged KV cache, behind one backend protocol.

Backends: `torch` (exact reference; the CPU path), `triton` (default on CUDA: one launch per mixed batch, any block
size, GQA, split-K for long decodes), `flash_attn` (FlashAttention-4, `flash_attn.cute`, on Hopper and newer where
it is installed), and `auto` on CUDA: per batch class, Triton or FA4 from a measured table (attention_choice.py).

    backend = get_backend(select_backend(device, block_size, head_dim, requested="auto"))
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = backend.attention(q, k_cache, v_cache, meta, scale)          # out=... writes into a given buffer
    backend.decode_variant(num_seqs, kv_heads, max_seqlen_k, device)   # launch variants, for CUDA graphs
    backend.warm_up(q_shape, k_cache, v_cache, max_model_len)          # compile every variant before serving

Also here: `triton_fused` (the fused element-wise kernels of a Llama layer: add + RMSNorm, rope + K/V write,
SiLU * up) and `compile_watch` (counts Triton compiles, so a server can show none happens after it is ready).
"""
import os

# Triton contracts a multiply and an add into one FMA ("FP fusion") by default up to 3.9; from 3.10 it will not
# unless told. Every kernel here was timed, its tiles and register caps chosen and its rounding checked against
# torch with contraction on, and the decode attention over an FP8 cache is bound by instruction issue, so keep it
# on unless the user has chosen otherwise (Triton reads this when it compiles, so importing order does not matter).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from .backend import AttentionBackend, available_backends, get_backend, select_backend  # noqa: E402
from .metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_backend", "select_backend"]

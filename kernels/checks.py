"""Shape, dtype and device checks shared by every backend: bad input gets a ValueError that says what is wrong."""
from __future__ import annotations

import operator

import torch

from .metadata import AttentionMetadata


def check_write_kv_inputs(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must both be [T, n_kv_heads, head_dim], got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    _check_caches(k_cache, v_cache)
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"key heads/head_dim {tuple(key.shape[1:])} do not match the cache's "
                         f"{tuple(k_cache.shape[2:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    _same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_kv_scales(k_cache, k_scale, v_scale)


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """An FP8 cache needs float32 scales, one per kv head, for K and for V; another cache takes none."""
    if k_cache.dtype != torch.float8_e4m3fn:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"KV scales are for an FP8 cache, this one is {k_cache.dtype}")
        return
    heads = k_cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (heads,):
            raise ValueError(f"an FP8 KV cache needs {name} as float32 [{heads}] (one per kv head), got "
                             f"{None if scale is None else (tuple(scale.shape), scale.dtype)}")
        if scale.device != k_cache.device:
            raise ValueError(f"{name} is on {scale.device}, the cache on {k_cache.device}")


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, window: int | None = None,
                           sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, n_heads, head_dim], got {tuple(q.shape)}")
    _check_caches(k_cache, v_cache)
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    if q.dtype != k_cache.dtype and k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    if sinks is not None:
        if tuple(sinks.shape) != (n_heads,):
            raise ValueError(f"sinks must be [n_heads={n_heads}], got {tuple(sinks.shape)}")
        _same_device(q=q, sinks=sinks)
    check_kv_scales(k_cache, k_scale, v_scale)
    _same_device(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens,
                 block_tables=meta.block_tables)
    key = (id(meta), q.shape[0])
    if key not in _recently_checked or _recently_checked[key] is not meta:
        _check_metadata(meta, q.shape[0], k_cache.shape[1])
        if len(_recently_checked) >= 16:
            _recently_checked.clear()
        _recently_checked[key] = meta


# Every layer of a forward pass gets one of a few metadata objects (one per KV block-table group, built once per
# step and never changed after): the host-side facts of each are checked on its first layer only.
_recently_checked: dict[tuple[int, int], AttentionMetadata] = {}


def _check_metadata(meta: AttentionMetadata, num_tokens: int, block_size: int) -> None:
    """Host-side facts of the batch, checked with C-level builtins where they loop over sequences."""
    q_lens, seq_lens = meta.q_lens_host, meta.seq_lens_host
    if len(q_lens) != len(seq_lens):
        raise ValueError("q_lens_host and seq_lens_host differ in length")
    if sum(q_lens) != num_tokens:
        raise ValueError(f"metadata describes {sum(q_lens)} new tokens, q has {num_tokens}")
    if q_lens and (min(q_lens) < 1 or not all(map(operator.le, q_lens, seq_lens))):
        b = next(b for b, (q, s) in enumerate(zip(q_lens, seq_lens)) if not 1 <= q <= s)
        raise ValueError(f"sequence {b}: need 1 <= q_len <= seq_len, got q_len={q_lens[b]} seq_len={seq_lens[b]}")
    max_blocks = -(-max(meta.seq_lens_host, default=0) // block_size)
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != meta.num_seqs \
            or meta.block_tables.shape[1] < max_blocks:
        raise ValueError(f"block_tables must be [B={meta.num_seqs}, >= {max_blocks}], "
                         f"got {tuple(meta.block_tables.shape)}")
    if tuple(meta.cu_seqlens_q.shape) != (meta.num_seqs + 1,) or tuple(meta.seq_lens.shape) != (meta.num_seqs,):
        raise ValueError(f"cu_seqlens_q must be [B+1] and seq_lens [B] for B={meta.num_seqs}, got "
                         f"{tuple(meta.cu_seqlens_q.shape)} and {tuple(meta.seq_lens.shape)}")
    if meta.max_seqlen_q != max(meta.q_lens_host, default=0):
        raise ValueError(f"max_seqlen_q {meta.max_seqlen_q} != max(q_lens_host) {max(meta.q_lens_host, default=0)}")


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must both be [num_blocks, block_size, n_kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")


def _same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")

"""Random mixed batches over a paged KV cache, for the kernel tests (tests/unit, tests/gpu).

Each sequence b has `ctx_lens[b]` tokens already cached and brings `q_lens[b]` new ones. Its K/V are drawn as dense
tensors first and then placed block by block through a shuffled block table, so the kernels' indexing is checked
against data laid out independently of them. Every cache slot that holds no context (unused blocks, the tail of a
sequence's last block, the slots the new tokens will be written to) is poisoned with NaN, and block-table padding
points at a poisoned block, so a kernel that reads past a context or through padding returns NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from metronome.kernels.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, n_heads, head_dim]
    key: torch.Tensor  # [T, n_kv_heads, head_dim]: the new tokens' K, to be written with write_kv
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, n_kv_heads, head_dim] with the cached context only
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]  # per sequence [seq_len, n_kv_heads, head_dim]: context + new tokens, in order
    dense_v: list[torch.Tensor]


def make_paged_batch(q_lens: list[int], ctx_lens: list[int], block_size: int, n_kv_heads: int, group: int,
                     head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     seed: int = 0, spare_blocks: int = 3, poison: float = float("nan")) -> PagedBatch:
    if len(q_lens) != len(ctx_lens) or not q_lens:
        raise ValueError("q_lens and ctx_lens must be non-empty and of equal length")
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    poisoned_block = order.pop()  # never allocated: block-table padding points here
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.full((len(q_lens), max_blocks), poisoned_block, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, n_kv_heads, head_dim), poison, dtype=dtype)
    v_cache = k_cache.clone()
    dense_k, dense_v, slots = [], [], []
    for b, (ctx, seq_len) in enumerate(zip(ctx_lens, seq_lens)):
        ids = [order.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, n_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, n_kv_heads, head_dim, generator=gen).to(dtype)
        dense_k.append(k)
        dense_v.append(v)
        for j, block in enumerate(ids):  # place the cached context block by block
            lo, hi = j * block_size, min((j + 1) * block_size, ctx)
            if hi > lo:
                k_cache[block, : hi - lo] = k[lo:hi]
                v_cache[block, : hi - lo] = v[lo:hi]
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(ctx, seq_len)]
    n_heads = n_kv_heads * group
    q = torch.randn(sum(q_lens), n_heads, head_dim, generator=gen).to(dtype)
    key = torch.cat([k[c:] for k, c in zip(dense_k, ctx_lens)])
    value = torch.cat([v[c:] for v, c in zip(dense_v, ctx_lens)])
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    dev = torch.device(device)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=tables.to(dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
        q_lens_host=list(q_lens), seq_lens_host=seq_lens,
    )
    return PagedBatch(q.to(dev), key.to(dev), value.to(dev), k_cache.to(dev), v_cache.to(dev), meta,
                      dense_k, dense_v)

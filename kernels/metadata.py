"""What one forward pass over a flat, mixed batch tells the attention kernels.

The batch is B sequences laid end to end: sequence b brings q_len_b new tokens (a prefill chunk, or 1 for a
decode) at positions seq_len_b - q_len_b ... seq_len_b - 1. Each new token attends causally to every cached
token of its sequence and to the new tokens up to itself. The KV cache of a layer is a pair of tensors
`[num_blocks, block_size, num_kv_heads, head_dim]` (flash-attn's paged layout); a sequence's block table lists
its blocks in order, so position p lives in block `block_tables[b, p // block_size]` at offset `p % block_size`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # int32 [B + 1] on the device: offsets of each sequence's new tokens in the batch
    seq_lens: torch.Tensor  # int32 [B] on the device: context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks] on the device; padding entries are never read
    slot_mapping: torch.Tensor  # int64 [T] on the device: cache slot (block * block_size + offset) per new token
    max_seqlen_q: int
    max_seqlen_k: int
    q_lens_host: list[int]  # the same facts on the host, for references and kernel launch grids
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_seqlen_q == 1


def scratch_metadata(q_lens: list[int], block: int, device: torch.device | str) -> AttentionMetadata:
    """A batch whose sequences have no cached context and read (never write: every slot is -1) one block, for
    warm-up launches. Each tensor is its own allocation (16-byte aligned, like the runner's staged arrays)."""
    cu = [0, *itertools.accumulate(q_lens)]

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return AttentionMetadata(cu_seqlens_q=ints(cu), seq_lens=ints(q_lens),
                             block_tables=ints([block] * len(q_lens)).view(len(q_lens), 1),
                             slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64, device=device),
                             max_seqlen_q=max(q_lens), max_seqlen_k=max(q_lens), q_lens_host=list(q_lens),
                             seq_lens_host=list(q_lens))

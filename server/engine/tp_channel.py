"""How rank 0 tells the tensor-parallel workers what to run: a small header over each worker's pipe, then the
step's tensors by one torch.distributed broadcast.

Why a pipe for the header: a worker waiting for the next step may wait for hours on an idle server, longer than
any collective timeout, while a blocking pipe read can wait forever and returns EOF the moment rank 0 dies.
So collectives happen only inside a step, and a worker that loses its parent exits at once.

Header (rank 0 → worker), little-endian int64 x 8: command, then for STEP: num_tokens T, num_seqs B,
block-table columns C, rows to sample N, max_seqlen_q, max_seqlen_k, KV groups G; followed by B int32 q_lens and
B int32 seq_lens (the host copies of the attention metadata, so a worker needs no device-to-host sync).
Payload (broadcast from rank 0, int64 on the device): input_ids[T], positions[T], G slot mappings[T],
sample_rows[N], cu_seqlens_q[B+1], seq_lens[B], G block tables[B*C]. A model whose layers keep their KV in
several groups (sliding-window and full layers: kv_layout.py) has a slot mapping and a block table per group.
Reply (worker → rank 0), int64 x 2: READY and the KV blocks the worker's memory allows.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from metronome.kernels.metadata import AttentionMetadata

STEP, SHUTDOWN, SET_NUM_BLOCKS, READY = 1, 2, 3, 4
_HEADER = struct.Struct("<8q")
_REPLY = struct.Struct("<2q")


class ChannelClosed(Exception):
    """The other end of a tensor-parallel pipe went away."""


@dataclass(frozen=True)
class StepHeader:
    num_tokens: int
    num_seqs: int
    block_cols: int
    num_sample: int
    max_seqlen_q: int
    max_seqlen_k: int
    q_lens: list[int]
    seq_lens: list[int]
    num_groups: int = 1  # KV groups, each with its slot mapping and block table

    @property
    def payload_numel(self) -> int:
        t, b, g = self.num_tokens, self.num_seqs, self.num_groups
        return (2 + g) * t + self.num_sample + (b + 1) + b + g * b * self.block_cols


def encode_step(header: StepHeader) -> bytes:
    fixed = _HEADER.pack(STEP, header.num_tokens, header.num_seqs, header.block_cols, header.num_sample,
                         header.max_seqlen_q, header.max_seqlen_k, header.num_groups)
    lens = np.asarray([*header.q_lens, *header.seq_lens], dtype="<i4").tobytes()
    return fixed + lens


def encode_command(command: int, argument: int = 0) -> bytes:
    return _HEADER.pack(command, argument, 0, 0, 0, 0, 0, 0)


def read_message(stream: BinaryIO) -> tuple[int, int, StepHeader | None]:
    """(command, first argument, StepHeader for STEP); ChannelClosed on EOF."""
    fields = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    command = fields[0]
    if command != STEP:
        return command, fields[1], None
    _, t, b, cols, n, max_q, max_k, groups = fields
    lens = np.frombuffer(_read_exact(stream, 8 * b), dtype="<i4").tolist()
    return STEP, t, StepHeader(t, b, cols, n, max_q, max_k, lens[:b], lens[b:], groups)


def encode_reply(num_blocks: int) -> bytes:
    return _REPLY.pack(READY, num_blocks)


def read_reply(stream: BinaryIO) -> int:
    kind, value = _REPLY.unpack(_read_exact(stream, _REPLY.size))
    if kind != READY:
        raise ChannelClosed(f"unexpected reply {kind}")
    return value


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            raise ChannelClosed("pipe closed")
        data += chunk
    return data


# ---- the step's tensors ---------------------------------------------------------------------------------------

def header_of(input_ids: torch.Tensor, metas: list[AttentionMetadata], sample_rows: torch.Tensor) -> StepHeader:
    """The header of a step whose KV groups have the metadata `metas` (one per group, in group order)."""
    meta = metas[0]
    return StepHeader(int(input_ids.shape[0]), meta.num_seqs, int(meta.block_tables.shape[1]),
                      int(sample_rows.shape[0]), meta.max_seqlen_q, meta.max_seqlen_k,
                      list(meta.q_lens_host), list(meta.seq_lens_host), len(metas))


def pack_payload(input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata],
                 sample_rows: torch.Tensor) -> torch.Tensor:
    long = torch.int64
    meta = metas[0]  # the groups share the sequence lengths; each has its own slots and block table
    return torch.cat([input_ids.to(long), positions.to(long), *(m.slot_mapping.to(long) for m in metas),
                      sample_rows.to(long), meta.cu_seqlens_q.to(long), meta.seq_lens.to(long),
                      *(m.block_tables.reshape(-1).to(long) for m in metas)])


def unpack_payload(payload: torch.Tensor, header: StepHeader
                   ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], torch.Tensor]:
    """(input_ids, positions, one metadata per KV group, sample_rows) with the dtypes ModelRunner.prepare
    produces."""
    t, b, n, g, cols = header.num_tokens, header.num_seqs, header.num_sample, header.num_groups, header.block_cols
    parts = payload.split([t, t, *[t] * g, n, b + 1, b, *[b * cols] * g])
    input_ids, positions, slots, (rows, cu, seq_lens), tables = parts[0], parts[1], parts[2:2 + g], \
        parts[2 + g:5 + g], parts[5 + g:]
    cu, seq_lens = cu.to(torch.int32), seq_lens.to(torch.int32)
    metas = [AttentionMetadata(
        cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=table.to(torch.int32).view(b, cols), slot_mapping=slot,
        max_seqlen_q=header.max_seqlen_q, max_seqlen_k=header.max_seqlen_k, q_lens_host=list(header.q_lens),
        seq_lens_host=list(header.seq_lens)) for slot, table in zip(slots, tables)]
    return input_ids, positions, metas, rows

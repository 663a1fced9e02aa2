"""How rank 0 tells the tensor-parallel workers what to run: a small header over each worker's pipe, then the
step's tensors by one torch.distributed broadcast.

Why a pipe for the header: a worker waiting for the next step may wait for hours on an idle server, longer than
any collective timeout, while a blocking pipe read can wait forever and returns EOF the moment rank 0 dies.
So collectives happen only inside a step, and a worker that loses its parent exits at once.

Header (rank 0 → worker), little-endian int64 x 8: command, then for STEP: num_tokens T, num_seqs B,
block-table columns C, rows to sample N, max_seqlen_q, max_seqlen_k; followed by B int32 q_lens and B int32
seq_lens (the host copies of the attention metadata, so a worker needs no device-to-host sync).
Payload (broadcast from rank 0, int64 on the device): input_ids[T], positions[T], slot_mapping[T],
sample_rows[N], cu_seqlens_q[B+1], seq_lens[B], block_tables[B*C].
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

    @property
    def payload_numel(self) -> int:
        t, b = self.num_tokens, self.num_seqs
        return 3 * t + self.num_sample + (b + 1) + b + b * self.block_cols


def encode_step(header: StepHeader) -> bytes:
    fixed = _HEADER.pack(STEP, header.num_tokens, header.num_seqs, header.block_cols, header.num_sample,
                         header.max_seqlen_q, header.max_seqlen_k, 0)
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
    _, t, b, cols, n, max_q, max_k, _ = fields
    lens = np.frombuffer(_read_exact(stream, 8 * b), dtype="<i4").tolist()
    return STEP, t, StepHeader(t, b, cols, n, max_q, max_k, lens[:b], lens[b:])


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

def header_of(input_ids: torch.Tensor, meta: AttentionMetadata, sample_rows: torch.Tensor) -> StepHeader:
    return StepHeader(int(input_ids.shape[0]), meta.num_seqs, int(meta.block_tables.shape[1]),
                      int(sample_rows.shape[0]), meta.max_seqlen_q, meta.max_seqlen_k,
                      list(meta.q_lens_host), list(meta.seq_lens_host))


def pack_payload(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 sample_rows: torch.Tensor) -> torch.Tensor:
    long = torch.int64
    return torch.cat([input_ids.to(long), positions.to(long), meta.slot_mapping.to(long), sample_rows.to(long),
                      meta.cu_seqlens_q.to(long), meta.seq_lens.to(long), meta.block_tables.reshape(-1).to(long)])


def unpack_payload(payload: torch.Tensor, header: StepHeader
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(input_ids, positions, meta, sample_rows) with the dtypes ModelRunner.prepare produces."""
    t, b, n = header.num_tokens, header.num_seqs, header.num_sample
    input_ids, positions, slots, rows, cu, seq_lens, tables = payload.split(
        [t, t, t, n, b + 1, b, b * header.block_cols])
    meta = AttentionMetadata(
        cu_seqlens_q=cu.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
        block_tables=tables.to(torch.int32).view(b, header.block_cols), slot_mapping=slots,
        max_seqlen_q=header.max_seqlen_q, max_seqlen_k=header.max_seqlen_k,
        q_lens_host=list(header.q_lens), seq_lens_host=list(header.seq_lens))
    return input_ids, positions, meta, rows

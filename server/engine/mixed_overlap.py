"""A mixed step as two micro-batches that run side by side: the decodes, memory-bound (their attention streams
every context token's K/V), beside the prompt chunk, compute-bound (its matmuls). Run as one batch, each layer
does the two kinds of work one after the other; split, the GPU can give the decodes' KV reads the bandwidth the
chunk's matmuls leave idle (two-batch overlap).

- The decode micro-batch is the step's leading decodes (the scheduler puts decodes first). It replays the decode
  CUDA graph of its padded size, the same graph a decode-only step replays (attention inside), on a side stream
  of higher priority.
- The chunk micro-batch is every other sequence of the step. It replays the piecewise graphs of its token bucket
  with its attentions launched between the pieces, on the main stream.
- The two share nothing they write: separate static inputs, separate graph memory pools and separate capture
  streams (so their matmuls do not share a cuBLAS workspace), disjoint KV slots. The side stream waits for the
  main stream's uploads before it starts, and the main stream waits for the side stream before the sampled rows
  are gathered, so the next step's uploads land after both.
- Each micro-batch computes exactly what the same rows compute in a step of their own: rows never mix in the
  model outside attention, and attention is per sequence. The price is that the decodes read the weights once
  more (their own matmuls), which is what the overlap must win back.

Pure decisions here (which steps split, where); the runner prepares the two parts and `run` launches them. On the
CPU (recorded graphs, tests) the two parts run one after the other with the same split and bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from metronome.server.engine.cuda_graphs import GraphRunner, GraphStep
from metronome.server.engine.piecewise_graphs import PieceStep, PiecewiseRunner

# The decode graphs of an overlapped engine are captured on a capture stream of their own: a cuBLAS workspace
# belongs to the stream a matmul was captured on, and the two micro-batches' matmuls run at the same time.
DECODE_LANE = "decode"


def leading_decodes(q_lens: np.ndarray) -> int:
    """How many sequences at the start of the batch bring one token each."""
    not_decode = np.flatnonzero(q_lens != 1)
    return int(not_decode[0]) if len(not_decode) else len(q_lens)


def split_point(q_lens: np.ndarray) -> int:
    """Where a mixed step splits: after its leading decodes, when there are some and something follows them;
    0: the step runs whole (decode-only, or no decode first)."""
    d = leading_decodes(q_lens)
    return d if 0 < d < len(q_lens) else 0


@dataclass
class OverlapStep:
    """A prepared overlapped step: the decode graph's step and the chunk's piece step, with the rows of each whose
    next token is sampled (device indices into each part's hidden states; decodes first, as the sampling
    order is)."""

    decodes: GraphStep
    chunk: PieceStep
    decode_rows: torch.Tensor
    chunk_rows: torch.Tensor


class MixedOverlap:
    """The switch and the side stream. `enabled` turns splitting on and off between steps (the graphs it needs are
    captured either way); `concurrent` False runs the two parts one after the other on the main stream (the same
    kernels, for comparisons)."""

    def __init__(self, device: torch.device, enabled: bool = True, concurrent: bool = True):
        self.device = device
        self.enabled = enabled
        self.concurrent = concurrent
        self._side: Any = None

    def side_stream(self) -> Any:
        if self._side is None:
            # Higher priority: the decode part's kernels take SMs as soon as any free up, ahead of queued chunk
            # blocks (their KV reads are the step's critical path once the matmuls run beside them).
            self._side = torch.cuda.Stream(self.device, priority=-1)
        return self._side

    def run(self, step: OverlapStep, meta: Any, pieces: PiecewiseRunner) -> torch.Tensor:
        """Both parts; the sampled rows' hidden states, decode rows first."""
        if self.concurrent and self.device.type == "cuda":
            main = torch.cuda.current_stream(self.device)
            side = self.side_stream()
            side.wait_stream(main)  # the step's uploads (both parts' static inputs) are on the main stream
            with torch.cuda.stream(side):
                decode_hidden = GraphRunner.run(step.decodes)
            chunk_hidden = pieces.run(step.chunk, meta)
            main.wait_stream(side)
        else:
            decode_hidden = GraphRunner.run(step.decodes)
            chunk_hidden = pieces.run(step.chunk, meta)
        return torch.cat([decode_hidden.index_select(0, step.decode_rows),
                          chunk_hidden.index_select(0, step.chunk_rows)])

"""A step as two nano-batches pipelined layer by layer: one nano-batch's attention beside the other's matmuls.

Once a step carries a few hundred tokens its matmuls are compute-bound, while its decodes' attention is
memory-bound (it streams every context token's K/V). Run as one batch, each layer does the two one after the
other. Here the step's tokens are cut in two, A (the first tokens: the decodes, then the start of the chunks) and B
(the rest; the cut may fall inside a prompt chunk), and each runs its own piecewise graphs (piecewise_graphs.py):
the pieces of both on one stream, in turn, and the attentions of both on a second stream,

    pieces:     A.p0  B.p0  A.p1  B.p1  A.p2 ...
    attention:        A.a0  B.a0  A.a1  B.a1 ...

so that A's attention of layer l runs beside B's matmuls of layer l, and B's beside A's of layer l + 1 (NanoFlow's
nano-batches). The pieces never run beside each other, so each keeps the tensor cores; each half reads the weights
once more than the whole step would, which costs nothing while a half is still compute-bound: hence a floor on its
tokens (NANO_MIN_TOKENS). Unlike the mixed-step overlap (mixed_overlap.py), which runs a step's decodes beside its
chunk and so reads the weights again for a few dozen memory-bound rows, the halves here are alike.

Exact: every row is computed as in the whole step (rows mix only in attention, and attention is per sequence). A
chunk cut in two keeps its order: B's rows of it attend to the K/V that A's rows of it wrote in A.p_l, which runs
before B.p_l on the pieces' stream and so before B.a_l.
- Buffers: each half has its own piecewise runner (static inputs, q and attention-output buffers, graph memory
  pool), since A.p_{l+1} runs while B.a_l still reads B's q and writes B's attention output.
- Streams: the pieces run on a stream of higher priority than the attentions' (the matmuls are short and every
  later launch waits on them; attention blocks fill the SMs they leave; the other way round, `attention_first`,
  measured the same on the H200). Both wait for the step's uploads on the current stream first, and the current
  stream waits for both before the sampled rows are gathered.
- On the CPU (recorded graphs, tests) the launches run one after the other in the same order.

Pure decisions here (whether and where a step is cut, each half's share of the batch); the runner uploads each
half's inputs and `NanoPipeline.run` launches them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from metronome.server.engine.piecewise_graphs import PieceStep, PiecewiseRunner

# A half's matmuls stay compute-bound from about here: the H200's matmul peak over its bandwidth is ~185 rows of
# bf16 and ~170 of e4m3 (weights read once per half).
NANO_MIN_TOKENS = 192
# The cut is rounded up to this (the token buckets' spacing below 1,024), so A fills its bucket exactly.
CUT_ALIGN = 64


def nano_cut(num_tokens: int, num_seqs: int, min_tokens: int = NANO_MIN_TOKENS) -> int:
    """Where a step of num_tokens over num_seqs sequences is cut (A = the tokens before it), or 0: the step runs
    whole. Decode-only steps run whole: cut, both halves are decodes whose attention streams KV while their
    matmuls need bandwidth too, and on the H200 the halves' overlap did not pay for the second read of the weights
    (saturation's decode steps at batch 714: 43.0 ms a step pipelined against 41.0 whole); a mixed step's A holds
    the decodes and B only prompt tokens, one memory-bound and one compute-bound (its steps there: 7 % faster)."""
    if num_tokens == num_seqs or num_tokens < 2 * min_tokens:
        return 0
    cut = -(-(num_tokens // 2) // CUT_ALIGN) * CUT_ALIGN
    return cut if min_tokens <= num_tokens - cut else num_tokens // 2


def lane_b_buckets(buckets: list[int], min_tokens: int = NANO_MIN_TOKENS) -> list[int]:
    """The token buckets B's piecewise graphs need, of the runner's own: from min_tokens (no half is smaller) up to
    half the largest (B is never the larger half); none where no step is long enough to cut. Pure."""
    top = -(-buckets[-1] // 2)
    return [b for b in buckets if min_tokens <= b <= top]


@dataclass(frozen=True)
class HalfBatch:
    """One nano-batch's share of a step: sequences [first, end) of the batch, their new tokens and lengths."""

    first: int
    end: int
    q_lens: np.ndarray
    seq_lens: np.ndarray

    @property
    def cu_seqlens(self) -> np.ndarray:
        cu = np.zeros(len(self.q_lens) + 1, dtype=np.int64)
        np.cumsum(self.q_lens, out=cu[1:])
        return cu


def split_batch(cu: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray, cut: int) -> tuple[HalfBatch, HalfBatch]:
    """The batch's two halves at token `cut` (0 < cut < total). A sequence the cut falls inside is in both: A has
    its first new tokens (its length ends at the cut), B the rest. Pure."""
    total = int(cu[-1])
    if not 0 < cut < total:
        raise ValueError(f"a cut at token {cut} of a step of {total}")
    i = int(np.searchsorted(cu, cut, side="right")) - 1  # the sequence that holds token `cut`
    inside = cu[i] < cut
    a_end = i + 1 if inside else i
    a_q, a_lens = q_lens[:a_end].copy(), seq_lens[:a_end].copy()
    b_q, b_lens = q_lens[i:].copy(), seq_lens[i:].copy()
    if inside:
        in_b = int(cu[i + 1]) - cut
        a_q[-1] -= in_b
        a_lens[-1] -= in_b
        b_q[0] = in_b
    return HalfBatch(0, a_end, a_q, a_lens), HalfBatch(i, len(q_lens), b_q, b_lens)


@dataclass
class PipelinedStep:
    """A prepared pipelined step: each half's piece step and attention metadata, and the rows of each whose next
    token is sampled (device indices into each half's hidden states; A's first, as the sampling order is)."""

    a: PieceStep
    b: PieceStep
    meta_a: Any
    meta_b: Any
    a_rows: torch.Tensor
    b_rows: torch.Tensor


class NanoPipeline:
    """The switch, B's piecewise runner (A's is the runner's own) and the two streams. `enabled` turns cutting on
    and off between steps; `concurrent` False launches the same halves on the current stream only (what the cut
    costs without the overlap, for comparisons)."""

    def __init__(self, device: torch.device, enabled: bool = True, concurrent: bool = True):
        self.device = device
        self.enabled = enabled
        self.concurrent = concurrent
        self.lane_b: PiecewiseRunner | None = None
        self.attention_first = False
        self._streams: tuple[Any, Any, bool] | None = None
        self._events: list[Any] = []

    def attach(self, lane_b: PiecewiseRunner | None) -> None:
        self.lane_b = lane_b

    def fits(self, a_tokens: int, b_tokens: int, lane_a: PiecewiseRunner) -> bool:
        return (self.lane_b is not None and lane_a.bucket_for(a_tokens) is not None
                and self.lane_b.bucket_for(b_tokens) is not None)

    def _gpu(self) -> tuple[Any, Any, list[Any]]:
        """(pieces' stream, attentions' stream, the four events); `attention_first` swaps the streams' priorities
        (for comparisons: whose blocks take the SMs that free up first)."""
        if self._streams is None or self._streams[2] != self.attention_first:
            first, second = (0, -1) if self.attention_first else (-1, 0)
            self._streams = (torch.cuda.Stream(self.device, priority=first),
                             torch.cuda.Stream(self.device, priority=second), self.attention_first)
            # re-recorded every layer: a wait is issued right after the record it waits for
            self._events = [torch.cuda.Event() for _ in range(4)]
        return (*self._streams[:2], self._events)

    def run(self, step: PipelinedStep, lane_a: PiecewiseRunner) -> torch.Tensor:
        """Both halves; the sampled rows' hidden states, A's first."""
        lane_b = self.lane_b
        na, nb = step.a.num_tokens, step.b.num_tokens
        halves = ((step.a.graphs.replays, lane_a.q_buf[:na], lane_a.attn_buf[:na], step.meta_a),
                  (step.b.graphs.replays, lane_b.q_buf[:nb], lane_b.attn_buf[:nb], step.meta_b))
        attend, kv_caches = lane_a.model.attend, lane_a.kv_caches
        last = len(halves[0][0]) - 1
        if self.concurrent and self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            pieces, attention, (a_piece, b_piece, a_attended, b_attended) = self._gpu()
            pieces.wait_stream(current)  # the step's uploads (both halves' static inputs) are on the current stream
            attention.wait_stream(current)
            marks = ((a_piece, a_attended), (b_piece, b_attended))
            for layer in range(last + 1):
                for (replays, q, out, meta), (piece_done, attended) in zip(halves, marks):
                    with torch.cuda.stream(pieces):
                        if layer:
                            pieces.wait_event(attended)  # this half's attention of the layer before
                        replays[layer]()
                        if layer == last:
                            continue
                        piece_done.record(pieces)
                    attention.wait_event(piece_done)
                    with torch.cuda.stream(attention):
                        attend(layer, q, kv_caches, meta, out)
                        attended.record(attention)
            current.wait_stream(pieces)
            current.wait_stream(attention)
        else:
            for layer in range(last + 1):
                for replays, q, out, meta in halves:
                    replays[layer]()
                    if layer < last:
                        attend(layer, q, kv_caches, meta, out)
        return torch.cat([step.a.graphs.hidden.index_select(0, step.a_rows),
                          step.b.graphs.hidden.index_select(0, step.b_rows)])

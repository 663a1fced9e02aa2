"""CUDA graphs for mixed steps (prefill chunks with decodes): the forward captured piece by piece per token bucket.

A mixed step's attention launch depends on its batch (tiles, grid and kv splits are chosen on the host from the
metadata), so it cannot be frozen without freezing the batch. Everything else in a layer works row by row and
reads only device buffers: from one layer's attention output to the next layer's q (o_proj, residual add, norm,
MLP, residual add, norm, qkv, rope, K/V write) is one piece (`LlamaForCausalLM.piece`). A forward of L layers is
L + 1 pieces with L attentions between them; each piece is captured once per padded token count (bucket), and a
step replays its bucket's pieces with the attentions launched eagerly between them over the step's own
metadata: 2 host launches per layer instead of ~45, and the attention sees exactly the eager step's batch.

- Padding: a step of n tokens runs in the smallest bucket >= n; rows n.. are token 0 at position 0 with slot -1
  (their K/V are never written). Attention reads only q[:n] and writes only out[:n], so padding rows never
  reach a real one (no other op mixes rows); their outputs are dropped.
- Buffers: the inputs (token ids, positions, slots, sample rows) are one static set sized for the largest
  bucket, refilled by one host-to-device copy per step; a bucket reads its leading rows, so every bucket sees the
  same addresses and strides. q and the attention output are shared by every layer and bucket too: each is
  consumed before the next piece overwrites it. The residual stream and the final hidden states are the
  pieces' own outputs, kept per bucket.
- Memory: the pieces share the decode graphs' pool. A piece's outputs stay referenced until the step that uses
  them ends, and within a step only one bucket's pieces run, in capture order, so no replay overwrites memory
  that a later piece of the same step still reads.

Capture is pluggable as for decode graphs (cuda_graphs.capture_cuda / capture_recorded): on CPU the recorded
capture re-runs each piece on the static buffers, which tests the padding and bookkeeping without a GPU.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from metronome.kernels.metadata import AttentionMetadata
from metronome.server.engine.cuda_graphs import Capture, capture_cuda

# Padded token counts captured: 64 apart up to 1024 (a chunk plus a decode batch rarely wastes more than a few
# percent), coarser above, where a step is long anyway. Larger steps run eager (launch time is hidden there).
TOKEN_BUCKETS = (8, 16, 32, 48, *range(64, 1024 + 1, 64), *range(1152, 2048 + 1, 128), *range(2304, 4096 + 1, 256))


def token_buckets(max_tokens: int) -> list[int]:
    """The buckets for steps of up to max_tokens tokens (max_tokens itself included when below the largest)."""
    buckets = [b for b in TOKEN_BUCKETS if b <= max_tokens]
    if max_tokens >= 1 and (not buckets or buckets[-1] < max_tokens) and max_tokens <= TOKEN_BUCKETS[-1]:
        buckets.append(max_tokens)
    return buckets


class PiecewiseModel(Protocol):
    num_pieces: int

    def piece(self, index: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
              slot_mapping: torch.Tensor, kv_caches: list, q_out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def attend(self, index: int, q: torch.Tensor, kv_caches: list, meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor: ...


class StaticTokens:
    """Device inputs for the largest bucket and the pinned host buffer they are refilled from.

    int64 buffer: input_ids [M] | positions [M] | sample_rows [M] | slot_mapping [M] per KV group
    """

    def __init__(self, max_tokens: int, device: torch.device, groups: int = 1):
        m = self.max_tokens = max_tokens
        on_cuda = device.type == "cuda"
        self.longs = torch.zeros((3 + groups) * m, dtype=torch.int64, device=device)
        self._host = torch.zeros((3 + groups) * m, dtype=torch.int64, pin_memory=on_cuda)
        self._copied = torch.cuda.Event() if on_cuda else None
        self.input_ids, self.positions, self.sample_rows = self.longs[:m], self.longs[m:2 * m], self.longs[2 * m:3 * m]
        self.slot_mappings = [self.longs[(3 + g) * m:(4 + g) * m] for g in range(groups)]
        self.slot_mapping = self.slot_mappings[0]
        h = self._host.numpy()
        self._ids, self._pos, self._rows = h[:m], h[m:2 * m], h[2 * m:3 * m]
        self._slots = [h[(3 + g) * m:(4 + g) * m] for g in range(groups)]
        for slots in self._slots:
            slots[:] = -1
        self._filled = 0  # rows holding real tokens since the last fill (the rest is padding already)

    def fill(self, token_ids: np.ndarray, positions: np.ndarray, slots, sample_rows: np.ndarray) -> None:
        """slots: one array, or one per KV group."""
        n = len(token_ids)
        if self._copied is not None:
            self._copied.synchronize()  # the last upload may still be reading the pinned buffer
        stale = self._filled
        if stale > n:  # rows the last step used and this one does not: back to padding
            self._ids[n:stale] = 0
            self._pos[n:stale] = 0
            for host in self._slots:
                host[n:stale] = -1
        slots = slots if isinstance(slots, (list, tuple)) else [slots]
        if len(slots) != len(self._slots):
            raise ValueError(f"a batch of {len(slots)} KV groups for pieces captured with {len(self._slots)}")
        self._ids[:n] = token_ids
        self._pos[:n] = positions
        for host, group_slots in zip(self._slots, slots):
            host[:n] = group_slots
        self._rows[:len(sample_rows)] = sample_rows
        self._filled = n
        self.longs.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


@dataclass
class BucketGraphs:
    bucket: int
    replays: list[Callable[[], None]]
    outputs: list[tuple[torch.Tensor, torch.Tensor | None]]  # each piece's (out, residual), kept alive

    @property
    def hidden(self) -> torch.Tensor:
        return self.outputs[-1][0]


@dataclass
class PieceStep:
    """A prepared mixed step: the bucket it runs in and its real token count."""

    graphs: BucketGraphs
    num_tokens: int


@dataclass
class PiecewiseReport:
    buckets: list[int] = field(default_factory=list)
    graphs: int = 0
    seconds: float = 0.0


class PiecewiseRunner:
    def __init__(self, model: PiecewiseModel, kv_caches: list, buckets: list[int], q_shape: tuple[int, int],
                 dtype: torch.dtype, scratch_block: int, device: torch.device, capture: Capture = capture_cuda,
                 pool: Any = None, layer_groups: tuple[int, ...] | None = None):
        """q_shape: (heads, head_dim) of this rank's attention; layer_groups: each layer's KV group where the model
        has several (kv_layout.py)."""
        if not buckets:
            raise ValueError("no token buckets to capture")
        self.layer_groups = layer_groups
        self.num_groups = 1 + max(layer_groups) if layer_groups else 1
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = sorted(set(buckets))
        self.device = device
        self.capture_fn = capture
        self.pool = pool
        self.scratch_block = scratch_block
        top = self.buckets[-1]
        self.static = StaticTokens(top, device, self.num_groups)
        self.q_buf = torch.zeros((top, *q_shape), dtype=dtype, device=device)
        self.attn_buf = torch.zeros((top, *q_shape), dtype=dtype, device=device)
        self.graphs: dict[int, BucketGraphs] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    # --- capture -------------------------------------------------------------------------------------------
    def _piece_fn(self, index: int, bucket: int, residual: torch.Tensor | None
                  ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        s = self.static
        x = s.input_ids[:bucket] if index == 0 else self.attn_buf[:bucket]
        last = index == self.model.num_pieces - 1
        q_out = None if last else self.q_buf[:bucket]
        model, kv_caches = self.model, self.kv_caches
        positions = s.positions[:bucket]
        slots = self._per_layer([group[:bucket] for group in s.slot_mappings])
        return lambda: model.piece(index, x, residual, positions, slots, kv_caches, q_out)

    def _per_layer(self, per_group: list):
        return per_group[0] if self.num_groups == 1 else [per_group[g] for g in self.layer_groups]

    def _dummy_meta(self, bucket: int) -> AttentionMetadata:
        """Every row a decode of one token on the scratch block (never written, so the same for every run)."""
        ints = torch.zeros(bucket + 1 + bucket + bucket, dtype=torch.int32, device=self.device)
        ints[:bucket + 1] = torch.arange(bucket + 1, dtype=torch.int32, device=self.device)
        ints[bucket + 1:2 * bucket + 1] = 1
        ints[2 * bucket + 1:] = self.scratch_block
        return AttentionMetadata(cu_seqlens_q=ints[:bucket + 1], seq_lens=ints[bucket + 1:2 * bucket + 1],
                                 block_tables=ints[2 * bucket + 1:].view(bucket, 1),
                                 slot_mapping=self.static.slot_mapping[:bucket], max_seqlen_q=1, max_seqlen_k=1,
                                 q_lens_host=[1] * bucket, seq_lens_host=[1] * bucket)

    def _eager_chain(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        residual = None
        for index in range(self.model.num_pieces):
            out, residual = self._piece_fn(index, bucket, residual)()
            if residual is None:
                return out
            self.model.attend(index, out, self.kv_caches, meta, out=self.attn_buf[:bucket])
        raise AssertionError("unreachable")

    def capture_all(self) -> PiecewiseReport:
        """Capture every bucket (largest first), each checked against an eager run of the same inputs."""
        start = time.perf_counter()
        rng = np.random.default_rng(0)
        for bucket in reversed(self.buckets):
            vocab_ids = rng.integers(0, 100, size=bucket)  # small ids exist in every vocabulary
            self.static.fill(vocab_ids, np.arange(bucket) % 64, [np.full(bucket, -1)] * self.num_groups,
                             np.zeros(0, dtype=np.int64))
            meta = self._dummy_meta(bucket)
            with torch.inference_mode():
                self._eager_chain(bucket, meta)  # warm-up: compiles, library handles, workspaces
                replays, outputs = [], []
                residual = None
                for index in range(self.model.num_pieces):
                    replay, output = self.capture_fn(self._piece_fn(index, bucket, residual), self.pool)
                    replays.append(replay)
                    outputs.append(output)
                    residual = output[1]
                graphs = BucketGraphs(bucket, replays, outputs)
                self._check(graphs, meta)
            self.graphs[bucket] = graphs
        return PiecewiseReport(list(self.buckets), len(self.buckets) * self.model.num_pieces,
                               time.perf_counter() - start)

    def _check(self, graphs: BucketGraphs, meta: AttentionMetadata) -> None:
        got = self.run(PieceStep(graphs, graphs.bucket), meta).float().clone()
        expected = self._eager_chain(graphs.bucket, meta).float()
        error = ((got - expected).norm() / expected.norm().clamp_min(1e-12)).item()
        if not (torch.isfinite(got).all().item() and error < 0.02):
            raise RuntimeError(f"the piecewise graphs of {graphs.bucket} tokens disagree with eager execution "
                               f"(relative RMS difference {error:.3g})")

    # --- per step ------------------------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def prepare(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                sample_rows: np.ndarray) -> tuple[PieceStep, torch.Tensor] | None:
        """Fill the static inputs; (step, sample rows on the device), or None when no bucket holds the step."""
        n = len(token_ids)
        bucket = self.bucket_for(n)
        if bucket is None or bucket not in self.graphs:
            return None
        self.static.fill(token_ids, positions, slots, sample_rows)
        return PieceStep(self.graphs[bucket], n), self.static.sample_rows[:len(sample_rows)]

    def inputs(self, step: PieceStep) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(input_ids, positions, slot mapping per KV group) of the step's real rows, on the device."""
        n = step.num_tokens
        s = self.static
        return s.input_ids[:n], s.positions[:n], [group[:n] for group in s.slot_mappings]

    def run(self, step: PieceStep, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the pieces with the step's attentions between them; hidden states of all bucket rows."""
        n = step.num_tokens
        q, out = self.q_buf[:n], self.attn_buf[:n]
        replays = step.graphs.replays
        attend, kv_caches = self.model.attend, self.kv_caches
        for index in range(len(replays) - 1):
            replays[index]()
            attend(index, q, kv_caches, meta, out)
        replays[-1]()
        return step.graphs.hidden

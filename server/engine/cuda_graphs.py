"""CUDA graphs for decode-only steps: the model forward captured once per padded batch size, replayed per step.
(Mixed steps: piecewise_graphs.py.)

An eager decode step of an 8B model is launch-bound (32 layers x ~15 kernel launches at 40-90 us of host time
each); a graph replays all of them with one launch. A graph replays fixed kernels on fixed addresses, so:

- Inputs live in static device buffers, one set per captured batch size, refilled in place before each replay by
  one host-to-device copy per dtype from pinned buffers (`StaticBatch`). A batch of n decodes runs in the smallest
  captured size >= n; the extra rows are dummy decodes: token 0 at position 0, seq_len 1, slot -1 (the KV write
  skips it) and a block table pointing at the runner's scratch block, which no sequence owns. Rows never mix in
  this model (matmuls, norms and rope are per row; attention is per sequence), so dummy rows cannot change real
  ones; their outputs are dropped.
- Block tables are captured at their full width (max blocks per sequence); a step fills only the columns its
  longest sequence needs. The kernels read a row only below ceil(seq_len / block_size), so stale columns past
  that are never read.
- Every launch decision must be the same at replay as at capture. An attention backend may decide on the host,
  from the metadata: the Triton one picks its tile class (fixed per padded size: every row is a decode) and a
  kv-split count (flash-decoding) that also depends on max_seqlen_k, a per-step value. The backend names these
  launch variants (`decode_variant`, `variant_lengths`); a size is captured once per variant that any context
  length up to max_model_len can produce (`SplitClasses`), and a step replays the graph of its own variant: the
  same kernels, tiles and splits that an eager step of the padded batch would launch, hence the same numbers.
- The metadata object of each graph is built once and kept (the kernels check and classify a metadata object
  once, by identity); its host lists describe the dummy batch it was captured with. Replays run no Python, so
  they never read those lists. Only the recorded (CPU) capture runs the model again at replay; it refreshes the
  host lists first, which is what lets the CPU tests check the padding logic with the torch reference backend.

`GraphRunner` owns the captured sizes; `ModelRunner` asks it for a step's inputs (`prepare`) and runs the replay.
Capture is pluggable: `capture_cuda` (a real torch.cuda.CUDAGraph, sharing one memory pool) or `capture_recorded`
(records the callable; used on CPU to test the static-buffer logic without a GPU).
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from metronome.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

# Padded batch sizes captured (up to the engine's max_num_seqs): dense where small batches are common.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# A capture returns (replay, output): replay() recomputes output in place from the static inputs.
Capture = Callable[[Callable[[], torch.Tensor], Any], tuple[Callable[[], None], torch.Tensor]]


def capture_sizes(max_batch: int) -> list[int]:
    """The sizes to capture for batches up to max_batch (max_batch itself included, so no step is left eager)."""
    sizes = [s for s in CAPTURE_SIZES if s <= max_batch]
    if max_batch >= 1 and (not sizes or sizes[-1] < max_batch) and max_batch <= CAPTURE_SIZES[-1]:
        sizes.append(max_batch)
    return sizes


_capture_streams: dict[tuple[int, str], Any] = {}


def capture_cuda(fn: Callable[[], Any], pool: Any, lane: str = "main") -> tuple[Callable[[], None], Any]:
    """Warm fn up on a side stream (Triton compiles, cuBLAS picks its kernels: neither may happen while
    capturing), then capture it into a CUDA graph in the shared pool. fn returns a tensor or a tuple of them
    (None allowed), which the graph rewrites in place at each replay. `lane` names the capture stream: graphs
    that will replay at the same time are captured on different lanes, because a captured matmul keeps the
    cuBLAS workspace of the stream it was captured on.

    CUDAGraph.capture_begin/end directly rather than `torch.cuda.graph`, whose synchronize + gc.collect +
    empty_cache per capture would dominate the start-up with the ~1,200 piece graphs of mixed steps."""
    key = (torch.cuda.current_device(), lane)
    side = _capture_streams.get(key)
    if side is None:
        side = _capture_streams[key] = torch.cuda.Stream()
    current = torch.cuda.current_stream()
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        fn()
        # thread_local: CUDA calls other threads make meanwhile (none expected) do not invalidate this capture.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            output = fn()
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph.replay, output


def _copy_outputs(captured: Any, fresh: Any) -> None:
    if isinstance(captured, torch.Tensor):
        captured.copy_(fresh)
        return
    for old, new in zip(captured, fresh):
        if old is not None and old is not new:
            old.copy_(new)


def capture_recorded(fn: Callable[[], Any], pool: Any) -> tuple[Callable[[], None], Any]:
    """No graph: replay calls fn again on the same static buffers and copies into the first outputs (CPU tests)."""
    output = fn()

    def replay() -> None:
        with torch.inference_mode():  # like the captured forward: no autograd state, whoever calls
            _copy_outputs(output, fn())

    return replay, output


def cuda_graph_pool() -> Any:
    return torch.cuda.graph_pool_handle()


@dataclass(frozen=True)
class SplitClasses:
    """Which captured variant of a padded size a step needs: `of(size, max_seqlen_k)` names the launch variant,
    `representatives(size)` gives one max_seqlen_k per variant that contexts up to max_model_len can produce,
    from `lengths`: context lengths among which every variant occurs (the attention backend says which)."""

    of: Callable[[int, int], int]
    max_model_len: int
    lengths: tuple[int, ...] = ()

    def representatives(self, size: int) -> dict[int, int]:
        # The largest length of a variant represents it.
        classes: dict[int, int] = {}
        for length in self.lengths or (self.max_model_len,):
            split_class = self.of(size, length)
            classes[split_class] = max(length, classes.get(split_class, 0))
        return classes


def single_class(max_model_len: int) -> SplitClasses:
    """Backends whose launches do not depend on the context length (and the recorded capture)."""
    return SplitClasses(lambda size, max_seqlen_k: 1, max_model_len)


def backend_split_classes(backend: Any, num_kv_heads: int, device: torch.device, max_model_len: int) -> SplitClasses:
    """The decode launch variants of an attention backend (its `decode_variant` and `variant_lengths`), for a
    decode-only batch: every row is one token of its own sequence."""
    return SplitClasses(lambda size, max_seqlen_k: backend.decode_variant(size, num_kv_heads, max_seqlen_k, device),
                        max_model_len, tuple(backend.variant_lengths(max_model_len)))


def per_group(value) -> list:
    """A per-group argument given as one array (a model with one KV group) or a list of them."""
    return value if isinstance(value, (list, tuple)) else [value]


class StaticBatch:
    """The device inputs of one padded size, and the pinned host buffers they are refilled from.

    int64 buffer: input_ids [S] | positions [S] | sample_rows [S] (only the first k used) | slot_mapping [S] per group
    int32 buffer: cu_seqlens_q [S + 1] | seq_lens [S] | block_tables [S, cols] per group
    """

    def __init__(self, size: int, cols: int, scratch_block: int, device: torch.device, groups: int = 1):
        self.size, self.cols, self.scratch_block, self.groups = size, cols, scratch_block, groups
        on_cuda = device.type == "cuda"
        self.longs = torch.zeros((3 + groups) * size, dtype=torch.int64, device=device)
        self.ints = torch.zeros(2 * size + 1 + groups * size * cols, dtype=torch.int32, device=device)
        self._host_longs = torch.zeros(self.longs.shape, dtype=torch.int64, pin_memory=on_cuda)
        self._host_ints = torch.zeros(self.ints.shape, dtype=torch.int32, pin_memory=on_cuda)
        self._copied = torch.cuda.Event() if on_cuda else None  # the last upload; host buffers are free after it
        s, t = size, size * cols
        self.input_ids, self.positions, self._sample_rows = self.longs[:s], self.longs[s:2 * s], self.longs[2 * s:3 * s]
        self.slot_mappings = [self.longs[(3 + g) * s:(4 + g) * s] for g in range(groups)]
        self.cu_seqlens_q, self.seq_lens = self.ints[:s + 1], self.ints[s + 1:2 * s + 1]
        base = 2 * s + 1
        self.group_block_tables = [self.ints[base + g * t:base + (g + 1) * t].view(s, cols) for g in range(groups)]
        self.slot_mapping, self.block_tables = self.slot_mappings[0], self.group_block_tables[0]
        hl, hi = self._host_longs.numpy(), self._host_ints.numpy()
        self._h_ids, self._h_pos, self._h_rows = hl[:s], hl[s:2 * s], hl[2 * s:3 * s]
        self._h_slots = [hl[(3 + g) * s:(4 + g) * s] for g in range(groups)]
        self._h_seq_lens = hi[s + 1:2 * s + 1]
        self._h_tables = [hi[base + g * t:base + (g + 1) * t].reshape(s, cols) for g in range(groups)]
        hi[:s + 1] = np.arange(s + 1)  # every row is one token: cu_seqlens_q never changes
        self._fill_padding(0)
        self.upload()

    def _fill_padding(self, n: int) -> None:
        self._h_ids[n:] = 0
        self._h_pos[n:] = 0
        self._h_seq_lens[n:] = 1
        for slots, tables in zip(self._h_slots, self._h_tables):
            slots[n:] = -1
            tables[n:] = self.scratch_block

    def fill(self, token_ids: np.ndarray, positions: np.ndarray, slots, seq_lens: np.ndarray, tables,
             sample_rows: np.ndarray) -> torch.Tensor:
        """Write n real decodes (n <= size) and padding into the host buffers, upload; returns sample_rows on the
        device. slots [n] and tables [n, c] (c <= cols: the block-table columns the batch needs) per group."""
        n = len(token_ids)
        slots, tables = per_group(slots), per_group(tables)
        if len(slots) != self.groups or len(tables) != self.groups:
            raise ValueError(f"a batch of {len(slots)} KV groups for graphs captured with {self.groups}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous upload may still be reading these pinned buffers
        self._h_ids[:n] = token_ids
        self._h_pos[:n] = positions
        for host_slots, host_tables, group_slots, group_tables in zip(self._h_slots, self._h_tables,
                                                                      slots, tables):
            host_slots[:n] = group_slots
            host_tables[:n, :group_tables.shape[1]] = group_tables
        self._h_seq_lens[:n] = seq_lens
        self._h_rows[:len(sample_rows)] = sample_rows
        self._fill_padding(n)
        self.upload()
        return self._sample_rows[:len(sample_rows)]

    def upload(self) -> None:
        self.longs.copy_(self._host_longs, non_blocking=True)
        self.ints.copy_(self._host_ints, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def metadata(self, max_seqlen_k: int) -> AttentionMetadata | list[AttentionMetadata]:
        """Metadata for capture: device views of this batch, host facts of the dummy batch (shared by the groups'
        objects); one object, or one per group."""
        q_host, lens_host = [1] * self.size, [1] * self.size
        metas = [AttentionMetadata(cu_seqlens_q=self.cu_seqlens_q, seq_lens=self.seq_lens, block_tables=tables,
                                   slot_mapping=slots, max_seqlen_q=1, max_seqlen_k=max_seqlen_k,
                                   q_lens_host=q_host, seq_lens_host=lens_host)
                 for slots, tables in zip(self.slot_mappings, self.group_block_tables)]
        return metas[0] if self.groups == 1 else metas


@dataclass
class CapturedGraph:
    static: StaticBatch
    meta: AttentionMetadata
    replay: Callable[[], None]
    output: torch.Tensor  # [size, hidden]: the forward's result after each replay


@dataclass
class GraphStep:
    """A prepared graph step: which graph to replay and how many of its rows are real."""

    graph: CapturedGraph
    num_real: int


@dataclass
class CaptureReport:
    sizes: list[int] = field(default_factory=list)
    graphs: int = 0
    seconds: float = 0.0


class GraphRunner:
    """Captured decode graphs for a model and its KV caches. `forward(input_ids, positions, meta)` is the model
    forward that gets captured; it must touch no host data of its own that changes between steps."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 sizes: list[int], block_cols: int, scratch_block: int, device: torch.device,
                 split_classes: SplitClasses, capture: Capture = capture_cuda, pool: Any = None,
                 refresh_host_facts: bool = False, layer_groups: tuple[int, ...] | None = None):
        """layer_groups: each layer's KV group where the model has several (kv_layout.py); None: one."""
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.layer_groups = layer_groups
        self.num_groups = 1 + max(layer_groups) if layer_groups else 1
        self.forward = forward
        self.sizes = sorted(set(sizes))
        self.block_cols = block_cols
        self.scratch_block = scratch_block
        self.device = device
        self.split_classes = split_classes
        self.capture_fn = capture
        self.pool = pool
        self.refresh_host_facts = refresh_host_facts  # recorded capture: replay re-runs Python over the metadata
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.statics: dict[int, StaticBatch] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> CaptureReport:
        """Capture every size (largest first, so the shared pool is sized once) and split class, checking each
        graph's first replay against an eager run of the same inputs. Raises on any failure."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            static = StaticBatch(size, self.block_cols, self.scratch_block, self.device, self.num_groups)
            self.statics[size] = static
            for split_class, max_seqlen_k in sorted(self.split_classes.representatives(size).items()):
                meta = static.metadata(max_seqlen_k)
                if self.num_groups > 1:  # the model takes one metadata object per layer
                    meta = [meta[g] for g in self.layer_groups]
                fn = self._bound(static, meta)
                with torch.inference_mode():
                    replay, output = self.capture_fn(fn, self.pool)
                    graph = CapturedGraph(static, meta, replay, output)
                    self._check(graph, fn, size, split_class)
                self.graphs[(size, split_class)] = graph
        return CaptureReport(list(self.sizes), len(self.graphs), time.perf_counter() - start)

    def _bound(self, static: StaticBatch, meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
        forward = self.forward
        return lambda: forward(static.input_ids, static.positions, meta)

    def _check(self, graph: CapturedGraph, fn: Callable[[], torch.Tensor], size: int, split_class: int) -> None:
        """The first replay against an eager run of the same inputs. The same kernels on the same data agree to
        rounding; a relative RMS bound (not bitwise) leaves room for a library choosing another matmul algorithm
        under capture, while a graph that reads the wrong memory is far off or not finite."""
        graph.replay()
        got, expected = graph.output.float(), fn().float()
        error = ((got - expected).norm() / expected.norm().clamp_min(1e-12)).item()
        if not (torch.isfinite(got).all().item() and error < 0.02):
            raise RuntimeError(f"the graph of batch size {size} (split class {split_class}) disagrees with eager "
                               f"execution (relative RMS difference {error:.3g})")

    # --- per step ------------------------------------------------------------------------------------------
    def padded_size(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def prepare(self, token_ids: np.ndarray, positions: np.ndarray, slots, seq_lens: np.ndarray,
                tables, sample_rows: np.ndarray) -> tuple[GraphStep, torch.Tensor] | None:
        """Fill the static inputs for a decode-only batch (one token per sequence; slots and tables: one array,
        or one per KV group); None if no graph fits."""
        n = len(token_ids)
        size = self.padded_size(n)
        if size is None or per_group(tables)[0].shape[1] > self.block_cols:
            return None
        max_seqlen_k = int(seq_lens.max())
        graph = self.graphs.get((size, self.split_classes.of(size, max_seqlen_k)))
        if graph is None:
            return None
        sample_dev = graph.static.fill(token_ids, positions, slots, seq_lens, tables, sample_rows)
        if self.refresh_host_facts:
            metas = per_group(graph.meta)
            metas[0].seq_lens_host[:] = seq_lens.tolist() + [1] * (size - n)  # one list, shared by the groups
            for meta in metas:
                meta.max_seqlen_k = max_seqlen_k
        return GraphStep(graph, n), sample_dev

    @staticmethod
    def run(step: GraphStep) -> torch.Tensor:
        """Replay; the forward's hidden states of all padded rows (real rows first)."""
        step.graph.replay()
        return step.graph.output

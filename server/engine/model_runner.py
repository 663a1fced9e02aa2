"""Turns a ScheduledBatch into one forward pass over a flat, mixed (varlen) token batch, and samples.

Host work is kept small because on a GPU it sits between forward passes: index math is vectorised with numpy,
each sequence's block table is mirrored into a persistent numpy row that is only appended to, and the inputs
travel in two pinned staging buffers with non-blocking copies. On CUDA a step runs one of three ways:
decode-only batches that fit a captured size replay a CUDA graph (cuda_graphs.py); other steps of up to the
largest token bucket replay piecewise graphs with eager attention between the pieces (piecewise_graphs.py);
anything larger runs eagerly. Every kernel variant is compiled at start-up (`warm_up`), before serving.

Under async scheduling (engine.py) a step is prepared while the previous one still runs: a decode's input token
may be that step's sample, not yet on the host (a PENDING placeholder in token_ids). `prepare` is then given
the previous step's ids on the device (`InFlightTokens`) and copies them into this step's input ids there, behind
the uploads and before the forward, in stream order: no host sync.

Each array of a staging buffer starts 16 bytes in: Triton specialises a kernel on whether a pointer is 16-byte
aligned, and an offset that moved with the batch size would compile a second variant in the middle of serving.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from metronome.kernels.metadata import AttentionMetadata, scratch_metadata
from metronome.server.engine.cuda_graphs import (
    Capture,
    GraphRunner,
    GraphStep,
    backend_split_classes,
    capture_cuda,
    capture_sizes,
    cuda_graph_pool,
)
from metronome.server.engine.kv_cache import allocate_kv_cache
from metronome.server.engine.kv_layout import KVLayout, kv_layout
from metronome.server.engine.mixed_overlap import DECODE_LANE, MixedOverlap, OverlapStep, split_point
from metronome.server.engine.nano_batches import (
    NANO_MIN_TOKENS,
    NanoPipeline,
    PipelinedStep,
    lane_b_buckets,
    nano_cut,
    split_batch,
)
from metronome.server.engine.piecewise_graphs import PieceStep, PiecewiseRunner, token_buckets
from metronome.server.engine.sampler import Sampler
from metronome.server.engine.scheduler import ScheduledBatch
from metronome.server.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata | list[AttentionMetadata]  # one for every layer, or one per layer (KV groups)
    sample_rows: torch.Tensor  # int64 [N]: rows of the hidden states whose next token is sampled
    sampling_seqs: list[Sequence]
    graph_step: GraphStep | None = None  # set when this step replays a captured CUDA graph (inputs are padded)
    piece_step: PieceStep | None = None  # set when this step replays piecewise graphs (mixed steps)
    overlap_step: OverlapStep | None = None  # set when a mixed step runs as two micro-batches (mixed_overlap.py)
    pipelined_step: PipelinedStep | None = None  # set when a step runs as two pipelined halves (nano_batches.py)

    @property
    def kind(self) -> str:
        """How the forward runs: "graph" (decode graph), "piecewise", "overlap" (decode graph beside the chunk's
        piecewise graphs), "pipeline" (two halves' piecewise graphs, layer by layer) or "eager"."""
        if self.overlap_step:
            return "overlap"
        if self.pipelined_step:
            return "pipeline"
        return "graph" if self.graph_step else "piecewise" if self.piece_step else "eager"


@dataclass
class InFlightTokens:
    """The chosen ids of the step in flight, on the device: `rows[seq]` is seq's row of `ids`."""

    ids: torch.Tensor
    rows: dict[Sequence, int]


def _aligned(parts: list[np.ndarray], dtype: type) -> tuple[np.ndarray, list[int]]:
    """Concatenate with each part starting on a 16-byte boundary; returns the buffer and each part's offset."""
    per = 16 // np.dtype(dtype).itemsize
    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += -(-len(part) // per) * per
    out = np.zeros(total, dtype=dtype)
    for part, offset in zip(parts, offsets):
        out[offset:offset + len(part)] = part
    return out, offsets


class BlockTableMirror:
    """One KV group's block tables as rows of one numpy array; a sequence keeps its row until released. A window
    group's entries freed behind the window keep their old value here: the kernels never read them."""

    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64, group: int = 0):
        self.group = group
        self.cols = max_blocks_per_seq
        self.table = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self.free_rows = list(range(initial_rows - 1, -1, -1))
        self.rows: dict[str, int] = {}  # request id -> row
        self.synced: dict[str, int] = {}  # request id -> entries of its table copied so far
        self.table_ids: dict[str, int] = {}  # request id -> id() of the list copied (a new list after preemption)

    def row_for(self, seq: Sequence) -> int:
        rid = seq.request_id
        row = self.rows.get(rid)
        blocks = seq.block_tables[self.group]
        if row is not None and self.synced[rid] == len(blocks) and self.table_ids[rid] == id(blocks):
            return row  # the common case: nothing new since the last step
        if row is None:
            if not self.free_rows:
                old = self.table.shape[0]
                self.table = np.concatenate([self.table, np.zeros_like(self.table)])
                self.free_rows = list(range(2 * old - 1, old - 1, -1))
            row = self.free_rows.pop()
            self.rows[rid] = row
            self.synced[rid] = 0
        if self.table_ids.get(rid) != id(blocks):  # re-allocated (preempted and admitted again)
            self.table_ids[rid] = id(blocks)
            self.synced[rid] = 0
        done = self.synced[rid]
        if done < len(blocks):
            if len(blocks) > self.cols:
                raise ValueError(f"{rid}: {len(blocks)} blocks exceed the {self.cols} a sequence may hold")
            self.table[row, done:len(blocks)] = blocks[done:]
            self.synced[rid] = len(blocks)
        return row

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)
            self.synced.pop(request_id, None)
            self.table_ids.pop(request_id, None)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, max_model_len: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0, layout: KVLayout | None = None, kv_dtype: torch.dtype | None = None):
        """layout: how the layers share the cache (kv_layout.py); None: one group of every layer. dtype: the
        model's (activations, q); kv_dtype: the cache's (default the model's; FP8 e4m3 possible)."""
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layout = layout or kv_layout((None,) * num_layers)
        if len(self.layout.layer_group) != num_layers:
            raise ValueError(f"a KV layout of {len(self.layout.layer_group)} layers for a model of {num_layers}")
        # One block more than the block manager hands out: the scratch block that padding rows of a captured
        # graph point at (never written: their slot is -1).
        self.scratch_block = num_blocks
        pairs = allocate_kv_cache(self.layout.group_size, num_blocks + 1, block_size, num_kv_heads, head_dim,
                                  kv_dtype or dtype, device)
        self.kv_caches = [pairs[slot] for slot in self.layout.layer_slot]
        self.sampler = Sampler(device, seed)
        cols = -(-max_model_len // block_size) + 1
        self.mirrors = [BlockTableMirror(cols, group=g) for g in range(self.layout.num_groups)]
        self.rope_long_offset = getattr(model, "rope_long_offset", 0)
        self.mirror = self.mirrors[0]
        self._on_cuda = device.type == "cuda"
        # name -> (pinned staging buffer, event after the last upload from it: then it may be rewritten)
        self._staging: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}
        self.graphs: GraphRunner | None = None
        self.pieces: PiecewiseRunner | None = None
        self.graph_capture_s: float | None = None
        # Mixed steps as two overlapped micro-batches (set before setup_cuda_graphs; None: never split).
        self.overlap: MixedOverlap | None = None
        # Steps as two halves pipelined layer by layer (set before setup_cuda_graphs; None: never cut).
        self.pipeline: NanoPipeline | None = None

    def release(self, seq: Sequence) -> None:
        """seq left the engine (finished or aborted)."""
        for mirror in self.mirrors:
            mirror.release(seq.request_id)

    def per_layer(self, per_group: list):
        """One value per group → what the model takes: the value itself for one group, else one per layer."""
        if len(per_group) == 1:
            return per_group[0]
        return [per_group[g] for g in self.layout.layer_group]

    # --- inputs --------------------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, in_flight: InFlightTokens | None = None) -> PreparedInputs:
        """The step's inputs on the device. `in_flight`: the ids of the step still running, for the tokens of
        this one that are PENDING on the host (async scheduling)."""
        entries = batch.entries
        num_seqs = len(entries)
        q_list, start_list, total_list, long_list = [], [], [], []
        group_rows: list[list[int]] = [[] for _ in self.mirrors]
        token_ids: list[int] = []
        pending: list[tuple[int, Sequence]] = []  # (row of this step's tokens, sequence) of PENDING tokens
        row_for = self.mirror.row_for
        row_list = group_rows[0]
        other_mirrors = list(enumerate(self.mirrors))[1:]
        for seq, n in entries:  # one pass over the sequences; everything else is vectorised
            c = seq.num_computed_tokens
            tokens = seq.token_ids
            if n == 1:
                token = tokens[c]
                if token < 0:
                    pending.append((len(token_ids), seq))
                token_ids.append(token)
            else:
                if c + n == len(tokens) and tokens[-1] < 0:  # a recompute that ends in the token in flight
                    pending.append((len(token_ids) + n - 1, seq))
                token_ids.extend(tokens[c:c + n])
            q_list.append(n)
            start_list.append(c)
            total_list.append(len(tokens))
            long_list.append(seq.rope_long)
            row_list.append(row_for(seq))
            for g, mirror in other_mirrors:
                group_rows[g].append(mirror.row_for(seq))
        q_lens = np.array(q_list, dtype=np.int64)
        starts = np.array(start_list, dtype=np.int64)
        seq_lens = starts + q_lens
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        max_cols = int(-(-seq_lens.max() // self.block_size))
        tables = [mirror.table[np.array(rows, dtype=np.int64), :max_cols]
                  for mirror, rows in zip(self.mirrors, group_rows)]

        seq_index = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - cu[:-1], q_lens)
        block_of, in_block = positions // self.block_size, positions % self.block_size
        slots = [table[seq_index, block_of].astype(np.int64) * self.block_size + in_block for table in tables]
        if self.rope_long_offset and any(long_list):  # LongRoPE: a long sequence reads the long-factor rows
            positions = positions + np.repeat(np.array(long_list, dtype=np.int64) * self.rope_long_offset, q_lens)

        sampling = seq_lens == np.array(total_list, dtype=np.int64)
        sample_rows = cu[1:][sampling] - 1
        sampling_seqs = [s for (s, _), flag in zip(entries, sampling.tolist()) if flag]

        token_array = np.asarray(token_ids, dtype=np.int64)
        if self.graphs is not None and num_tokens == num_seqs:  # decode-only (one token each): a graph may fit
            prepared = self.graphs.prepare(token_array, positions, slots, seq_lens, tables, sample_rows)
            if prepared is not None:
                step, sample_dev = prepared
                static = step.graph.static
                if pending:
                    self._fill_pending(static.input_ids, pending, in_flight)
                return PreparedInputs(static.input_ids, static.positions, step.graph.meta, sample_dev, sampling_seqs,
                                      step)
        if self.pipeline is not None and self.pipeline.enabled and self.pieces is not None:
            cut = nano_cut(num_tokens, num_seqs)
            if cut and self.pipeline.fits(cut, num_tokens - cut, self.pieces):
                return self._prepare_pipelined(cut, token_array, positions, slots, cu, q_lens, seq_lens, tables,
                                               sample_rows, sampling_seqs, pending, in_flight)
        if self.overlap is not None and self.overlap.enabled and self.graphs is not None and self.pieces is not None:
            d = split_point(q_lens)
            if d:
                overlapped = self._prepare_overlapped(d, token_array, positions, slots, cu, q_lens, seq_lens, tables,
                                                      sample_rows, sampling_seqs, pending, in_flight)
                if overlapped is not None:
                    return overlapped
        t = num_tokens
        piece = self.pieces.prepare(token_array, positions, slots, sample_rows) if self.pieces is not None else None
        if piece is None:
            longs, offsets = _aligned([token_array, positions, sample_rows, *slots], np.int64)
            longs_dev = self._to_device("longs", longs)
            o_ids, o_pos, o_rows = offsets[:3]
            input_ids, positions_dev = longs_dev[o_ids:o_ids + t], longs_dev[o_pos:o_pos + t]
            sample_dev = longs_dev[o_rows:o_rows + len(sample_rows)]
            slots_dev = [longs_dev[o:o + t] for o in offsets[3:]]
        else:
            step, sample_dev = piece
            input_ids, positions_dev, slots_dev = self.pieces.inputs(step)
        if pending:
            self._fill_pending(input_ids, pending, in_flight)
        meta = self._metadata(cu, q_lens, seq_lens, tables, slots_dev)
        return PreparedInputs(input_ids, positions_dev, meta, sample_dev, sampling_seqs,
                              piece_step=piece[0] if piece is not None else None)

    def _metadata(self, cu: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray, tables: list[np.ndarray],
                  slots_dev: list[torch.Tensor], staging: str = "ints"):
        """The attention metadata of a batch (one object, or one per layer), its int32 arrays uploaded in one copy
        (through the staging buffer named `staging`: a second batch of the same step needs its own)."""
        b = len(q_lens)
        max_cols = tables[0].shape[1]
        ints, offsets = _aligned([cu.astype(np.int32), seq_lens.astype(np.int32),
                                  *(table.reshape(-1) for table in tables)], np.int32)
        ints_dev = self._to_device(staging, ints)
        o_cu, o_lens = offsets[:2]
        cu_dev, lens_dev = ints_dev[o_cu:o_cu + b + 1], ints_dev[o_lens:o_lens + b]
        q_host, lens_host = q_lens.tolist(), seq_lens.tolist()  # shared by the groups' metadata
        max_q, max_k = int(q_lens.max()), int(seq_lens.max())
        metas = [AttentionMetadata(cu_seqlens_q=cu_dev, seq_lens=lens_dev,
                                   block_tables=ints_dev[o:o + b * max_cols].view(b, max_cols), slot_mapping=slot,
                                   max_seqlen_q=max_q, max_seqlen_k=max_k, q_lens_host=q_host,
                                   seq_lens_host=lens_host)
                 for o, slot in zip(offsets[2:], slots_dev)]
        return self.per_layer(metas)

    def _prepare_overlapped(self, d: int, token_ids: np.ndarray, positions: np.ndarray, slots: list[np.ndarray],
                            cu: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray, tables: list[np.ndarray],
                            sample_rows: np.ndarray, sampling_seqs: list[Sequence],
                            pending: list[tuple[int, Sequence]], in_flight: InFlightTokens | None
                            ) -> PreparedInputs | None:
        """A mixed step as its d leading decodes (a decode graph) and the rest (piecewise graphs), or None when
        either part fits no captured graph (the step then runs whole). Rows d.. of the batch are rows 0.. of the
        chunk part; sampling order (decodes first) is kept."""
        if self.pieces.bucket_for(len(token_ids) - d) is None:
            return None
        chunk_sampled = sample_rows >= d
        decodes = self.graphs.prepare(token_ids[:d], positions[:d], [s[:d] for s in slots], seq_lens[:d],
                                      [table[:d] for table in tables], sample_rows[~chunk_sampled])
        if decodes is None:
            return None
        chunk_lens = seq_lens[d:]
        chunk_cols = int(-(-chunk_lens.max() // self.block_size))
        chunk = self.pieces.prepare(token_ids[d:], positions[d:], [s[d:] for s in slots],
                                    sample_rows[chunk_sampled] - d)
        if chunk is None:
            return None
        (decode_step, decode_rows), (chunk_step, chunk_rows) = decodes, chunk
        input_ids, positions_dev, slots_dev = self.pieces.inputs(chunk_step)
        if pending:
            decode_ids = decode_step.graph.static.input_ids
            on_decodes = [(row, seq) for row, seq in pending if row < d]
            on_chunk = [(row - d, seq) for row, seq in pending if row >= d]
            if on_decodes:
                self._fill_pending(decode_ids, on_decodes, in_flight)
            if on_chunk:
                self._fill_pending(input_ids, on_chunk, in_flight)
        meta = self._metadata(cu[d:] - d, q_lens[d:], chunk_lens, [table[d:, :chunk_cols] for table in tables],
                              slots_dev)
        step = OverlapStep(decode_step, chunk_step, decode_rows, chunk_rows)
        return PreparedInputs(input_ids, positions_dev, meta, chunk_rows, sampling_seqs, overlap_step=step)

    def _prepare_pipelined(self, cut: int, token_ids: np.ndarray, positions: np.ndarray, slots: list[np.ndarray],
                           cu: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray, tables: list[np.ndarray],
                           sample_rows: np.ndarray, sampling_seqs: list[Sequence],
                           pending: list[tuple[int, Sequence]], in_flight: InFlightTokens | None) -> PreparedInputs:
        """A step as its first `cut` tokens (A, on the runner's piecewise graphs) and the rest (B, on the pipeline's
        own); the caller checked that both fit a bucket. Rows cut.. of the batch are rows 0.. of B; a sequence cut
        in two samples from B (its last token is there), so the sampling order (A's rows first) is kept."""
        half_a, half_b = split_batch(cu, q_lens, seq_lens, cut)
        in_b = sample_rows >= cut
        lanes = (self.pieces, self.pipeline.lane_b)
        parts = []
        for lane, half, rows, lo, hi, staging in ((lanes[0], half_a, sample_rows[~in_b], 0, cut, "ints"),
                                                  (lanes[1], half_b, sample_rows[in_b] - cut, cut, None, "ints_b")):
            step, rows_dev = lane.prepare(token_ids[lo:hi], positions[lo:hi], [s[lo:hi] for s in slots], rows)
            input_ids, _, slots_dev = lane.inputs(step)
            mine = [(row - lo, seq) for row, seq in pending if lo <= row and (hi is None or row < hi)]
            if mine:
                self._fill_pending(input_ids, mine, in_flight)
            cols = int(-(-half.seq_lens.max() // self.block_size))
            meta = self._metadata(half.cu_seqlens, half.q_lens, half.seq_lens,
                                  [table[half.first:half.end, :cols] for table in tables], slots_dev, staging)
            parts.append((step, rows_dev, meta))
        (a, a_rows, meta_a), (b, b_rows, meta_b) = parts
        step = PipelinedStep(a, b, meta_a, meta_b, a_rows, b_rows)
        input_ids, positions_dev, _ = lanes[0].inputs(a)
        return PreparedInputs(input_ids, positions_dev, meta_a, a_rows, sampling_seqs, pipelined_step=step)

    def _fill_pending(self, input_ids: torch.Tensor, pending: list[tuple[int, Sequence]],
                      in_flight: InFlightTokens | None) -> None:
        """input_ids[row] = the in-flight step's id for each PENDING token, on the device."""
        if in_flight is None:
            raise RuntimeError(f"{pending[0][1].request_id}: a PENDING token but no step in flight to read it from")
        k = len(pending)
        index = np.empty(2 * k, dtype=np.int64)  # this step's rows | the in-flight step's rows
        for j, (row, seq) in enumerate(pending):
            index[j] = row
            index[k + j] = in_flight.rows[seq]
        rows, sources = index[:k], index[k:]
        if rows[-1] - rows[0] == k - 1 and np.array_equal(sources, np.arange(sources[0], sources[0] + k)):
            # the steady decode batch: the same sequences in the same order, one copy and no index upload
            input_ids[rows[0]:rows[0] + k].copy_(in_flight.ids[sources[0]:sources[0] + k])
            return
        index_dev = self._to_device("pending", index)
        input_ids.index_copy_(0, index_dev[:k], in_flight.ids.index_select(0, index_dev[k:]))

    def _to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if not self._on_cuda:
            return host
        staging, uploaded = self._staging.get(name, (None, None))
        if staging is None or staging.numel() < host.numel() or staging.dtype != host.dtype:
            staging = torch.empty(max(host.numel(), 4096) * 2, dtype=host.dtype, pin_memory=True)
            uploaded = torch.cuda.Event()
            self._staging[name] = (staging, uploaded)
        else:
            uploaded.synchronize()  # the last step's upload may still read it (under async scheduling it ran
            # before that step's forward, and the forward before it has been read: done, or nearly)
        buf = staging[: host.numel()]
        buf.copy_(host)
        device_copy = buf.to(self.device, non_blocking=True)
        uploaded.record()
        return device_copy

    # --- CUDA graphs ----------------------------------------------------------------------------------------
    def graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.forward(input_ids, positions, self.kv_caches, meta)

    def attach_graphs(self, graphs: GraphRunner | None) -> None:
        """Use these captured graphs for decode-only steps that fit them (None: eager only)."""
        self.graphs = graphs

    def attach_pieces(self, pieces: PiecewiseRunner | None) -> None:
        """Use these piecewise graphs for the other steps that fit a token bucket (None: eager)."""
        self.pieces = pieces

    def piecewise_runner(self, buckets: list[int], capture=capture_cuda, pool=None) -> PiecewiseRunner:
        """Piecewise graphs of this runner's model (one with `piece`/`attend`, e.g. LlamaForCausalLM)."""
        k_cache = self.kv_caches[0][0]
        heads = self.model.config.num_attention_heads  # this rank's heads under tensor parallelism
        return PiecewiseRunner(self.model, self.kv_caches, buckets, (heads, k_cache.shape[3]), self.dtype,
                               self.scratch_block, self.device, capture, pool, self.layer_groups)

    @property
    def layer_groups(self) -> tuple[int, ...] | None:
        """Each layer's KV group where there are several (graph runners take one metadata object per layer)."""
        return self.layout.layer_group if self.layout.num_groups > 1 else None

    def setup_cuda_graphs(self, max_batch: int, max_model_len: int, max_tokens: int = 4096) -> str:
        """Capture decode-step graphs for batches up to max_batch, and piecewise graphs for other steps of up to
        max_tokens tokens, where that is safe: on CUDA, as far as the attention backend allows (`graph_capture`:
        "all" where its decode launches were checked to need no host data at replay, "pieces" where only the
        pieces around its eager attentions may be captured). With the mixed-step overlap, the decode graphs get
        a memory pool and a capture stream of their own (they replay beside the pieces). Returns the execution
        mode: "cuda_graphs", "cuda_graphs: decode only (<why>)", "cuda_graphs: mixed steps only (<why>)" or
        "eager: <why>". Never raises: a failed capture is logged, and the engine runs eager (or without the
        graphs that failed)."""
        backend = getattr(self.model, "attention_backend", None)
        name = getattr(backend, "name", None)
        allowed = getattr(backend, "graph_capture", "none")
        if not self._on_cuda:
            return "eager: not on CUDA"
        if allowed == "none":
            return f"eager: attention backend {name!r} is not captured"
        model_problem = getattr(self.model, "graph_capture_problem", None)
        problem = model_problem(self.device) if model_problem is not None else None
        if problem:
            return f"eager: {problem}"
        sizes = capture_sizes(max_batch)
        if not sizes:
            return "eager: no batch size to capture"
        pool = None
        with torch.cuda.device(self.device):
            self.model.prepare_rope_tables(self.device, self.dtype)  # never inside a capture
        if allowed == "all":
            try:
                with torch.cuda.device(self.device):
                    num_kv_heads = self.kv_caches[0][0].shape[2]
                    pool = cuda_graph_pool()
                    capture = capture_cuda
                    if self.overlap is not None:
                        capture = functools.partial(capture_cuda, lane=DECODE_LANE)
                    graphs = GraphRunner(self.graph_forward, sizes, self.mirror.cols, self.scratch_block,
                                         self.device,
                                         backend_split_classes(backend, num_kv_heads, self.device, max_model_len),
                                         capture, pool, layer_groups=self.layer_groups)
                    report = graphs.capture_all()
                    torch.cuda.synchronize(self.device)
            except Exception as exc:  # noqa: BLE001 - any capture failure means "serve eager", never "crash"
                return self._capture_failed("CUDA graph", exc)
            self.graphs = graphs
            self.graph_capture_s = report.seconds
            log.info("captured %d CUDA graphs for decode batches of %s sequences in %.1f s", report.graphs,
                     ",".join(map(str, report.sizes)), report.seconds)
        decode_only = "cuda_graphs: decode only" if self.graphs is not None else "eager"
        buckets = token_buckets(max_tokens)
        if not buckets or not hasattr(self.model, "piece"):
            return f"{decode_only} (no token bucket or a model without pieces)"
        if pool is None or self.overlap is not None:  # overlapped steps replay both kinds at once
            pool = cuda_graph_pool()
        try:
            with torch.cuda.device(self.device):
                pieces = self.piecewise_runner(buckets, capture_cuda, pool)
                piece_report = pieces.capture_all()
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - decode graphs stay; mixed steps run eager
            return f"{decode_only} (" + self._capture_failed("piecewise graph", exc, keep_graphs=True) + ")"
        self.pieces = pieces
        self.graph_capture_s = (self.graph_capture_s or 0.0) + piece_report.seconds
        log.info("captured %d piecewise graphs for mixed steps of up to %d tokens (%d buckets) in %.1f s",
                 piece_report.graphs, buckets[-1], len(buckets), piece_report.seconds)
        if self.pipeline is not None:
            with torch.cuda.device(self.device):
                self.capture_pipeline_lane()
        if self.graphs is None:
            return f"cuda_graphs: mixed steps only (attention backend {name!r} runs decode steps eagerly)"
        return "cuda_graphs"

    def capture_pipeline_lane(self, capture: Capture = capture_cuda, min_tokens: int = NANO_MIN_TOKENS) -> bool:
        """The second half's piecewise graphs for pipelined steps (nano_batches.py: `lane_b_buckets`), in a memory
        pool of their own (its attentions run beside the first half's pieces). Needs `pipeline` set and the
        pieces captured; False (steps then run whole) where the capture fails."""
        half = lane_b_buckets(self.pieces.buckets, min_tokens)
        if not half:
            log.info("no step of up to %d tokens is long enough to cut: steps run whole", self.pieces.max_tokens)
            return False
        pool = cuda_graph_pool() if self._on_cuda else None
        try:
            lane_b = self.piecewise_runner(half, capture, pool)
            report = lane_b.capture_all()
            if self._on_cuda:
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - the pipeline is an optimisation: steps run whole without it
            log.warning("pipelined-step graph capture failed; steps run whole: %s: %s", type(exc).__name__, exc,
                        exc_info=True)
            return False
        self.pipeline.attach(lane_b)
        self.graph_capture_s = (self.graph_capture_s or 0.0) + report.seconds
        log.info("captured %d piecewise graphs for the second half of pipelined steps (up to %d tokens) in %.1f s",
                 report.graphs, half[-1], report.seconds)
        return True

    def _capture_failed(self, what: str, exc: Exception, keep_graphs: bool = False) -> str:
        log.warning("%s capture failed; running without it: %s: %s", what, type(exc).__name__, exc, exc_info=True)
        if not keep_graphs:
            self.graphs = None
        self.pieces = None
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - best effort; eager steps report any real device error
            pass
        return f"eager: {what} capture failed ({type(exc).__name__}: {exc})"

    def warm_up(self, max_model_len: int) -> int:
        """Compile every kernel variant a step can launch, before the server is ready: the attention backend's
        variants (tile classes x kv splits) and one eager forward of a padding token (the fused element-wise
        kernels of the eager path). Returns the launches made."""
        backend = getattr(self.model, "attention_backend", None)
        k_cache, v_cache = self.kv_caches[0]
        heads = getattr(getattr(self.model, "config", None), "num_attention_heads", None)
        launches = 0
        with torch.inference_mode():
            if backend is not None and heads is not None:
                config = self.model.config
                windows = tuple(dict.fromkeys(getattr(config, "layer_windows", None) or (None,)))
                dtype = {"dtype": self.dtype} if k_cache.dtype != self.dtype else {}  # an FP8 cache
                launches += backend.warm_up((1, heads, k_cache.shape[3]), k_cache, v_cache, max_model_len,
                                            windows=windows, softcap=getattr(config, "attn_logit_softcapping", None),
                                            sinks=getattr(config, "attention_sinks", False), **dtype)
            warm_kernels = getattr(self.model, "warm_up_kernels", None)
            if warm_kernels is not None:  # kernels of the model's own (the MoE tile classes)
                launches += warm_kernels(self.device)
            meta = scratch_metadata([1], self.scratch_block, self.device)
            zero = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.model.forward(zero, zero, self.kv_caches, meta)
            launches += 1
        if self._on_cuda:
            torch.cuda.synchronize(self.device)
        return launches

    # --- forward + sample ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_logits(self, inputs: PreparedInputs) -> torch.Tensor | None:
        if inputs.overlap_step is not None:  # decodes always sample: there are rows
            return self.model.compute_logits(self.overlap.run(inputs.overlap_step, inputs.meta, self.pieces))
        if inputs.pipelined_step is not None:
            hidden = self.pipeline.run(inputs.pipelined_step, self.pieces)
            return self.model.compute_logits(hidden) if inputs.sampling_seqs else None
        if inputs.graph_step is not None:
            hidden = GraphRunner.run(inputs.graph_step)  # padded rows; sample_rows pick real ones
        elif inputs.piece_step is not None:
            hidden = self.pieces.run(inputs.piece_step, inputs.meta)
        else:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampling_seqs:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

"""Turns a ScheduledBatch into one forward pass over a flat, mixed (varlen) token batch, and samples.

Host work is kept small because on a GPU it sits between forward passes: index math is vectorised with numpy,
each sequence's block table is mirrored into a persistent numpy row that is only appended to, and the inputs
travel in two pinned staging buffers with non-blocking copies. Decode-only batches that fit a captured size
replay a CUDA graph instead (cuda_graphs.py): the same host arrays, written into that graph's static buffers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from metronome.kernels.metadata import AttentionMetadata
from metronome.server.engine.cuda_graphs import (GraphRunner, GraphStep, capture_cuda, capture_sizes, cuda_graph_pool,
                                                 triton_split_classes)
from metronome.server.engine.kv_cache import allocate_kv_cache
from metronome.server.engine.sampler import Sampler
from metronome.server.engine.scheduler import ScheduledBatch
from metronome.server.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [N]: rows of the hidden states whose next token is sampled
    sampling_seqs: list[Sequence]
    graph_step: GraphStep | None = None  # set when this step replays a captured CUDA graph (inputs are padded)


class BlockTableMirror:
    """Block tables as rows of one numpy array; a sequence keeps its row until released."""

    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64):
        self.cols = max_blocks_per_seq
        self.table = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self.free_rows = list(range(initial_rows - 1, -1, -1))
        self.rows: dict[str, int] = {}  # request id -> row
        self.synced: dict[str, int] = {}  # request id -> entries of its table copied so far
        self.table_ids: dict[str, int] = {}  # request id -> id() of the list copied (a new list after preemption)

    def row_for(self, seq: Sequence) -> int:
        rid = seq.request_id
        row = self.rows.get(rid)
        blocks = seq.block_table
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
        blocks = seq.block_table
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
                 seed: int = 0):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # One block more than the block manager hands out: the scratch block that padding rows of a captured
        # graph point at (never written: their slot is -1).
        self.scratch_block = num_blocks
        self.kv_caches = allocate_kv_cache(num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype,
                                           device)
        self.sampler = Sampler(device, seed)
        self.mirror = BlockTableMirror(-(-max_model_len // block_size) + 1)
        self._on_cuda = device.type == "cuda"
        self._staging: dict[str, torch.Tensor] = {}
        self._staged = torch.cuda.Event() if self._on_cuda else None  # the last upload from the staging buffers
        self.graphs: GraphRunner | None = None
        self.graph_capture_s: float | None = None

    def release(self, seq: Sequence) -> None:
        """seq left the engine (finished or aborted)."""
        self.mirror.release(seq.request_id)

    # --- inputs --------------------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> PreparedInputs:
        entries = batch.entries
        num_seqs = len(entries)
        q_list, start_list, total_list, row_list = [], [], [], []
        token_ids: list[int] = []
        row_for = self.mirror.row_for
        for seq, n in entries:  # one pass over the sequences; everything else is vectorised
            c = seq.num_computed_tokens
            tokens = seq.token_ids
            if n == 1:
                token_ids.append(tokens[c])
            else:
                token_ids.extend(tokens[c:c + n])
            q_list.append(n)
            start_list.append(c)
            total_list.append(len(tokens))
            row_list.append(row_for(seq))
        q_lens = np.array(q_list, dtype=np.int64)
        starts = np.array(start_list, dtype=np.int64)
        seq_lens = starts + q_lens
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        rows = np.array(row_list, dtype=np.int64)
        max_cols = int(-(-seq_lens.max() // self.block_size))
        block_tables = self.mirror.table[rows, :max_cols]

        seq_index = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - cu[:-1], q_lens)
        slot_mapping = (block_tables[seq_index, positions // self.block_size].astype(np.int64) * self.block_size
                        + positions % self.block_size)

        sampling = seq_lens == np.array(total_list, dtype=np.int64)
        sample_rows = cu[1:][sampling] - 1
        sampling_seqs = [s for (s, _), flag in zip(entries, sampling.tolist()) if flag]

        if self.graphs is not None and num_tokens == num_seqs:  # decode-only (one token each): a graph may fit
            prepared = self.graphs.prepare(np.asarray(token_ids, dtype=np.int64), positions, slot_mapping, seq_lens,
                                           block_tables, sample_rows)
            if prepared is not None:
                step, sample_dev = prepared
                static = step.graph.static
                return PreparedInputs(static.input_ids, static.positions, step.graph.meta, sample_dev, sampling_seqs,
                                      step)
        longs = np.concatenate([np.asarray(token_ids, dtype=np.int64), positions, slot_mapping, sample_rows])
        ints = np.concatenate([cu.astype(np.int32), seq_lens.astype(np.int32), block_tables.reshape(-1)])
        longs_dev = self._to_device("longs", longs)
        ints_dev = self._to_device("ints", ints)
        t, b = num_tokens, num_seqs
        meta = AttentionMetadata(
            cu_seqlens_q=ints_dev[: b + 1],
            seq_lens=ints_dev[b + 1: 2 * b + 1],
            block_tables=ints_dev[2 * b + 1:].view(b, max_cols),
            slot_mapping=longs_dev[2 * t: 3 * t],
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(seq_lens.max()),
            q_lens_host=q_lens.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )
        return PreparedInputs(longs_dev[:t], longs_dev[t: 2 * t], meta, longs_dev[3 * t:], sampling_seqs)

    def _to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if not self._on_cuda:
            return host
        if self._staged is not None and name == "longs":
            self._staged.synchronize()  # the last step's upload may still read the staging buffers (no sync if
            # that step sampled nothing)
        staging = self._staging.get(name)
        if staging is None or staging.numel() < host.numel() or staging.dtype != host.dtype:
            staging = torch.empty(max(host.numel(), 4096) * 2, dtype=host.dtype, pin_memory=True)
            self._staging[name] = staging
        buf = staging[: host.numel()]
        buf.copy_(host)
        device_copy = buf.to(self.device, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        return device_copy

    # --- CUDA graphs ----------------------------------------------------------------------------------------
    def graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.forward(input_ids, positions, self.kv_caches, meta)

    def attach_graphs(self, graphs: GraphRunner | None) -> None:
        """Use these captured graphs for decode-only steps that fit them (None: eager only)."""
        self.graphs = graphs

    def setup_cuda_graphs(self, max_batch: int, max_model_len: int) -> str:
        """Capture decode-step graphs for batches up to max_batch where that is safe: on CUDA with the Triton
        attention backend (the only one whose launches were checked to need no host data at replay). Returns the
        execution mode: "cuda_graphs", or "eager: <why>". Never raises: a failed capture is logged, and the engine
        runs eager."""
        backend = getattr(getattr(self.model, "attention_backend", None), "name", None)
        if not self._on_cuda:
            return "eager: not on CUDA"
        if backend != "triton":
            return f"eager: attention backend {backend!r} is not captured (only triton is)"
        sizes = capture_sizes(max_batch)
        if not sizes:
            return "eager: no batch size to capture"
        try:
            with torch.cuda.device(self.device):
                num_kv_heads = self.kv_caches[0][0].shape[2]
                graphs = GraphRunner(self.graph_forward, sizes, self.mirror.cols, self.scratch_block, self.device,
                                     triton_split_classes(num_kv_heads, self.device, max_model_len), capture_cuda,
                                     cuda_graph_pool())
                report = graphs.capture_all()
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - any capture failure means "serve eager", never "crash"
            log.warning("CUDA graph capture failed; running eager (slower decode): %s: %s", type(exc).__name__, exc,
                        exc_info=True)
            self.graphs = None
            try:
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - best effort; eager steps report any real device error
                pass
            return f"eager: CUDA graph capture failed ({type(exc).__name__}: {exc})"
        self.graphs = graphs
        self.graph_capture_s = report.seconds
        log.info("captured %d CUDA graphs for decode batches of %s sequences in %.1f s", report.graphs,
                 ",".join(map(str, report.sizes)), report.seconds)
        return "cuda_graphs"

    # --- forward + sample ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_logits(self, inputs: PreparedInputs) -> torch.Tensor | None:
        if inputs.graph_step is not None:
            hidden = GraphRunner.run(inputs.graph_step)  # padded rows; sample_rows pick real ones
        else:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampling_seqs:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int]]:
        """Run one step; return the sequences that got a new token and those tokens."""
        inputs = self.prepare(batch)
        logits = self.forward_logits(inputs)
        if logits is None:
            if self._on_cuda:
                torch.cuda.current_stream(self.device).synchronize()
            return [], []
        seqs = inputs.sampling_seqs
        tokens = self.sampler.sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        return seqs, tokens

"""Rank 0's model runner under tensor parallelism: before its own forward pass it sends the step to the
workers (header over their pipes, tensors by broadcast), so every rank runs the same batch on its shard.
Sampling stays on rank 0; the logits every rank computes are already whole (all-gathered over the vocabulary)."""
from __future__ import annotations

from typing import Protocol

import torch

from metronome.server.engine.model_runner import ModelRunner, PreparedInputs
from metronome.server.engine.tp_channel import StepHeader, header_of, pack_payload


class StepSender(Protocol):
    """What the runner needs of the worker pool (tp_launch.WorkerPool): announce a step to every worker."""

    def send_step(self, header: StepHeader) -> None: ...


class TensorParallelRunner(ModelRunner):
    def __init__(self, workers: StepSender, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.workers = workers
        # the first layer of each KV group: where a step's per-layer metadata holds that group's
        self.group_first_layers = [self.layout.layer_group.index(g) for g in range(self.layout.num_groups)]

    @torch.inference_mode()
    def forward_logits(self, inputs: PreparedInputs) -> torch.Tensor | None:
        import torch.distributed as dist

        metas = self.group_metadata(inputs.meta)
        self.workers.send_step(header_of(inputs.input_ids, metas, inputs.sample_rows))
        dist.broadcast(pack_payload(inputs.input_ids, inputs.positions, metas, inputs.sample_rows), src=0)
        return super().forward_logits(inputs)

    def group_metadata(self, meta) -> list:
        """One metadata object per KV group, from what the model takes (one object, or one per layer)."""
        if not isinstance(meta, (list, tuple)):
            return [meta]
        return [meta[layer] for layer in self.group_first_layers]

"""Rank 0's side of tensor parallelism: start one worker process per extra rank, join their process group on
127.0.0.1, and drive them (see tp_channel.py for the protocol, tp_worker.py for the worker).

Rendezvous: rank 0 opens a TCPStore on 127.0.0.1 with a port the OS picks (no race for a "free" port) and hands
the port to the workers on their command line. Each rank uses its own device: cuda:(base + rank), or the CPU
with gloo. A worker exits when its pipe closes (rank 0 died or shut down), when its parent process changes, or
on the SHUTDOWN command; shutdown() and an atexit hook make sure no worker outlives rank 0.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from metronome.contract.errors import InvalidRequestError, MetronomeError
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.tp_channel import (
    SET_NUM_BLOCKS,
    SHUTDOWN,
    ChannelClosed,
    StepHeader,
    encode_command,
    encode_step,
    read_reply,
)
from metronome.server.models.device import resolve_device
from metronome.server.models.parallel import TPContext, plan_shards

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
# Collectives run only inside a step (idle waits are pipe reads), so this bounds one step, not idle time.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
_SHUTDOWN_WAIT_S = 10.0


def check_in_key(rank: int) -> str:
    return f"metronome/tp/check-in/{rank}"


class TensorParallelError(MetronomeError):
    """A tensor-parallel worker failed or could not be started."""


def rank_devices(device: str, world_size: int) -> list[torch.device]:
    """The device of every rank: all CPU, or consecutive GPUs starting at the one asked for (cuda = cuda:0)."""
    base = resolve_device(device, check_available=False)  # the GPU count below says how many are missing
    if base.type == "cpu":
        return [torch.device("cpu")] * world_size
    first = base.index or 0
    available = torch.cuda.device_count()
    if first + world_size > available:
        raise InvalidRequestError(
            f"tensor_parallel_size {world_size} starting at cuda:{first} needs {first + world_size} GPUs; "
            f"{available} visible", param="tensor_parallel_size")
    return [torch.device("cuda", first + rank) for rank in range(world_size)]


def share_cpu_threads(world_size: int) -> None:
    """CPU ranks share the host's cores: without an explicit OMP_NUM_THREADS, give each rank its share instead
    of letting N ranks each start a thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))


def _loopback_env() -> dict[str, str]:
    """Keep gloo and NCCL's bootstrap sockets on the loopback interface."""
    return {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
            "MASTER_ADDR": HOST}


class WorkerPool:
    """Ranks 1..N-1 as child processes, and rank 0's membership of the group."""

    def __init__(self, config: EngineConfig, model_config: Any):
        import torch.distributed as dist

        if dist.is_initialized():
            raise TensorParallelError("torch.distributed is already initialised in this process: one "
                                      "tensor-parallel engine per process (close the other one first)")
        self.world_size = config.tensor_parallel_size
        self.plan = plan_shards(model_config, self.world_size)  # indivisible heads fail before anything starts
        self.devices = rank_devices(config.device, self.world_size)
        self.device = self.devices[0]
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._closed = False
        self._expected_exit = False
        self.procs: list[subprocess.Popen] = []
        os.environ.update(_loopback_env())
        store = dist.TCPStore(HOST, 0, self.world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)
        # PYTHONSAFEPATH: `-m` would put the working directory first on the worker's path, and run from a checkout
        # its top-level folders (kernels/, operator/) hide the installed packages of those names (transformers
        # imports Hugging Face's `kernels`).
        env = {**os.environ, "MASTER_PORT": str(store.port), "PYTHONSAFEPATH": "1"}
        config_json = json.dumps(dataclasses.asdict(config))
        atexit.register(self.shutdown)
        try:
            for rank in range(1, self.world_size):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "metronome.server.engine.tp_worker", str(rank), str(store.port),
                     str(self.devices[rank]), config_json],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))
            self._wait_for_check_in(store)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            else:
                share_cpu_threads(self.world_size)
            dist.init_process_group(self.backend, store=store, rank=0, world_size=self.world_size,
                                    timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self.shutdown()
            raise
        self.context = TPContext(0, self.world_size, None)
        threading.Thread(target=self._watch, name="tp-worker-watch", daemon=True).start()

    def _wait_for_check_in(self, store: Any) -> None:
        """Every worker reached the store: a worker that dies on start-up fails here at once instead of
        leaving init_process_group waiting for its timeout."""
        for rank, proc in enumerate(self.procs, start=1):
            while not store.check([check_in_key(rank)]):
                if proc.poll() is not None:
                    raise self._failure(rank, "while starting")
                threading.Event().wait(0.05)

    @property
    def kv_heads_per_rank(self) -> int:
        return self.plan.num_kv_heads

    @property
    def runner_class(self):
        from metronome.server.engine.tp_runner import TensorParallelRunner

        return partial(TensorParallelRunner, self)

    # --- commands ------------------------------------------------------------------------------------------
    def agree_num_blocks(self, own: int) -> int:
        """Wait for every worker's model to load; all ranks then allocate the smallest cache any of them fits."""
        counts = [own]
        for rank, proc in enumerate(self.procs, start=1):
            try:
                counts.append(read_reply(proc.stdout))
            except ChannelClosed:
                raise self._failure(rank, "before its model was loaded") from None
        agreed = min(counts)
        self._send_all(encode_command(SET_NUM_BLOCKS, agreed))
        return agreed

    def send_step(self, header: StepHeader) -> None:
        self._send_all(encode_step(header))

    def _send_all(self, message: bytes) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel workers were shut down")
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.stdin.write(message)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                raise self._failure(rank, "while the engine was running") from None

    def _failure(self, rank: int, when: str) -> TensorParallelError:
        proc = self.procs[rank - 1]
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return TensorParallelError(f"tensor-parallel worker rank {rank} stopped {when} (exit code {code}; "
                                   "its error is in the log above)")

    # --- lifecycle -----------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """A dead rank leaves NCCL collectives on the others hanging until the timeout; on CUDA, exit instead
        so the pod restarts (gloo raises in the pending collective by itself)."""
        while not self._closed:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self._expected_exit:
                    log.error("tensor-parallel worker rank %d exited with code %s", rank, proc.returncode)
                    if self.backend == "nccl":
                        self._kill_all()
                        os._exit(1)
                    return
            threading.Event().wait(0.5)

    def shutdown(self) -> None:
        """Stop the workers (SHUTDOWN, then SIGTERM/SIGKILL if they linger) and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._expected_exit = True
        atexit.unregister(self.shutdown)
        for proc in self.procs:
            try:
                proc.stdin.write(encode_command(SHUTDOWN))
                proc.stdin.close()
            except (BrokenPipeError, ValueError, OSError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=_SHUTDOWN_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
        self._kill_all()
        for proc in self.procs:
            if proc.stdout is not None:
                proc.stdout.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_tensor_parallel(engine_class: type, config: EngineConfig, scheduler_config: Any) -> Any:
    """EngineCore.from_config for tensor_parallel_size > 1: workers first (they load their shards while rank 0
    loads its own), then rank 0's engine; no worker survives a failure on the way."""
    from metronome.server.models.loader import load_model, read_model_config

    pool = WorkerPool(config, read_model_config(config.model))
    try:
        loaded = load_model(config.model, dtype=config.dtype, device=str(pool.device),
                            attention_backend=config.attention_backend, seed=config.seed,
                            block_size=config.block_size, tensor_parallel=pool.context,
                            quantization=config.quantization)
        return engine_class(loaded, config, scheduler_config, workers=pool)
    except BaseException:
        pool.shutdown()
        raise

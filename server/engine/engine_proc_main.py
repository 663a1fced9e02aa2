"""The engine process: builds the EngineCore itself and runs its step loop, fed by commands from the API process
(engine_process.py). AsyncEngine's loop without a thread: the HTTP event loop lives in another process, so it
never holds the GIL an engine step needs.

Protocol (two one-way multiprocessing pipes; everything pickled):
- API → engine: a list of commands per send, each a tuple `(kind, seq, *args)` with seq increasing by one:
  (ADD, seq, token_ids, params, request_id, arrival_time), (ABORT, seq, request_id), (RECONFIGURE, seq, config),
  (STOP, seq). Requests arrive validated (request_limits.py); arrival_time is time.monotonic(), one clock for
  every process on the host, as are the TokenEvent times that come back.
- engine → API: first (READY, ReadyInfo) or (FAILED, exception); then one message per step, and one after
  commands applied while idle: (event rows, failures, step stats or None, engine stats, seq of the last command
  applied). An event row is a TokenEvent's field values in order (a tuple pickles ~5x faster than the
  dataclass); failures are (request id, exception) of requests that ended with an error.

The process ignores SIGINT and SIGTERM: the API process owns shutdown (it drains first, then sends STOP). It
exits on STOP, when its command pipe closes, or when its parent changes (the API process was killed).
"""
from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import MetronomeError
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.outputs import EngineStats

ADD, ABORT, RECONFIGURE, STOP = "add", "abort", "reconfigure", "stop"
READY, FAILED = "ready", "failed"
IDLE_POLL_S = 1.0  # an idle engine wakes this often to see whether its parent is still there

log = logging.getLogger("metronome.engine")


@dataclass(frozen=True)
class ChildSettings:
    log_level: int  # the API process's root log level
    cpu_threads: int | None  # torch threads for an engine on the CPU (None: torch's default)


@dataclass(frozen=True)
class ReadyInfo:
    """What the API process needs of the engine without holding it."""

    pid: int
    model_name: str
    vocab_size: int
    max_model_len: int
    max_waiting: int
    kv_capacity_tokens: int  # BlockManager.max_admissible_tokens()
    eos_token_ids: tuple[int, ...]
    stats: EngineStats
    startup_summary: str
    device_type: str  # "cuda" | "cpu"
    tensor_parallel_size: int
    tokenizer: Any  # the engine's tokenizer object (both tokenizer classes pickle)


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling both ways (the API process re-raises it as is), else a RuntimeError that
    names its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def child_main(commands: Connection, replies: Connection, engine_config: EngineConfig,
               scheduler_config: SchedulerConfig, settings: ChildSettings) -> None:
    """The process's entry point (multiprocessing "spawn")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    try:
        core = _build(engine_config, scheduler_config, settings)
    except BaseException as exc:
        if not isinstance(exc, (MetronomeError, ValueError)):
            log.exception("the engine could not start")  # an unexpected error: its traceback lives only here
        replies.send((FAILED, portable(exc)))
        return
    try:
        replies.send((READY, ReadyInfo(
            os.getpid(), core.model_name, core.vocab_size, core.max_model_len, core.config.max_waiting,
            core.block_manager.max_admissible_tokens(), tuple(sorted(core.eos_token_ids)), core.stats(),
            core.startup_summary(), core.runner.device.type, core.config.tensor_parallel_size, core.tokenizer)))
        # As `serve` does in-process (serve_cli.freeze_startup_heap): full collections walk only what serving
        # allocates, not the ~200k start-up objects (a 100 ms pause each time otherwise).
        gc.collect()
        gc.freeze()
        _Loop(core, commands, replies, parent).run()
    except (BrokenPipeError, EOFError, ConnectionError):
        pass  # the API process is gone: nobody to serve
    finally:
        core.close()


def _build(engine_config: EngineConfig, scheduler_config: SchedulerConfig, settings: ChildSettings):
    from metronome.server.engine.engine import EngineCore  # torch: only in this process

    core = EngineCore.from_config(engine_config, scheduler_config)
    if core.runner.device.type == "cpu" and settings.cpu_threads is not None:
        import torch

        torch.set_num_threads(settings.cpu_threads)
        log.info("CPU engine: %d torch thread(s), one core left for HTTP (set OMP_NUM_THREADS to choose)",
                 settings.cpu_threads)
    return core


class _Loop:
    def __init__(self, core, commands: Connection, replies: Connection, parent: int):
        self.core = core
        self.commands = commands
        self.replies = replies
        self.parent = parent
        self.acked = 0  # seq of the last command applied
        self.applied = False  # commands were applied since the last message
        self.stopped = False

    def run(self) -> None:
        core = self.core
        while True:
            if not self._receive(0.0 if core.has_unfinished() else IDLE_POLL_S) or self.stopped:
                return
            if not core.has_unfinished():
                if self.applied:  # an idle engine's new state (a reconfiguration, an abort) still shows
                    self._send([], [], None)
                continue
            try:
                events, step_stats = core.step()
            except Exception as exc:  # keep serving: fail the requests in flight, not the process
                log.exception("engine step failed")
                failure = portable(exc)
                self._send([], [(request_id, failure) for request_id in core.abort_all()], None)
                continue
            failures = [(request_id, portable(exc)) for request_id, exc in core.take_failures()]
            self._send([tuple(event.__dict__.values()) for event in events], failures, step_stats)

    def _receive(self, timeout: float) -> bool:
        """Apply every command that has arrived, waiting up to `timeout` for the first; False when the API
        process is gone."""
        commands = self.commands
        if not commands.poll(timeout):
            return os.getppid() == self.parent
        while True:
            try:
                batch = commands.recv()
            except EOFError:
                return False
            for command in batch:
                self._apply(command)
            if self.stopped or not commands.poll(0.0):
                return True

    def _apply(self, command: tuple) -> None:
        kind, seq = command[0], command[1]
        self.acked = seq
        self.applied = True
        core = self.core
        if kind == ADD:
            token_ids, params, request_id, arrival = command[2:]
            try:
                core.add_prepared(token_ids, params, request_id, arrival)
            except Exception as exc:  # validated in the API process, so rare (a grammar matcher that fails)
                log.exception("request %s could not be added", request_id)
                self._send([], [(request_id, portable(exc))], None)
        elif kind == ABORT:
            core.abort(command[2])
        elif kind == RECONFIGURE:
            try:
                core.reconfigure(command[2])
            except Exception:
                log.exception("reconfiguration failed")
        elif kind == STOP:
            self.stopped = True

    def _send(self, rows: list[tuple], failures: list, step_stats) -> None:
        self.replies.send((rows, failures, step_stats, self.core.stats(), self.acked))
        self.applied = False

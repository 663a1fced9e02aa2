"""The engine process: builds the EngineCore itself and runs its step loop, fed by commands from the API process
(engine_process.py). AsyncEngine's loop without a thread: the HTTP event loop lives in another process, so it
never holds the GIL an engine step needs.

Protocol (per API server, two one-way multiprocessing pipes; everything pickled):
- API → engine: a list of commands per send, each a tuple `(kind, seq, *args)` with seq increasing by one:
  (ADD, seq, token_ids, params, request_id, arrival_time), (ABORT, seq, request_id), (RECONFIGURE, seq, config),
  (STOP, seq). Requests arrive validated (request_limits.py); arrival_time is time.monotonic(), one clock for
  every process on the host, as are the TokenEvent times that come back.
- engine → API: first (READY, ReadyInfo) or (FAILED, exception); then one message per step, and one after
  commands applied while idle: (event rows, failures, step stats or None, engine stats, seq of the last command
  applied). An event row is a TokenEvent's field values in order (a tuple pickles ~5x faster than the
  dataclass); failures are (request id, exception) of requests that ended with an error.

With several API servers (`serve --api-servers N`, api_servers.py) the process serves N such channels, one per
API server ("client"): READY goes to client 0 only (the main process hands ReadyInfo to the others); request ids
need only be unique per client, as the core knows each request as "client:id"; after every step each client gets
one message with only its own events and failures, the shared EngineStats and the ack of its own last command;
StepStats go to client 0 alone, so the step histograms are observed once. A client's STOP or closed pipe
detaches it: its requests are aborted (KV freed) and the others go on. With one client ids are the API's own.

The process ignores SIGINT and SIGTERM: the API process owns shutdown (it drains first, then sends STOP). It
exits once every client has sent STOP or closed its pipe, or when its parent changes (the API process was killed).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection, wait
from typing import Any

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import MetronomeError
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.outputs import EngineStats, TokenEvent
from metronome.server.engine.serving_process import freeze_startup_heap

ADD, ABORT, RECONFIGURE, STOP = "add", "abort", "reconfigure", "stop"
READY, FAILED = "ready", "failed"
FINISHED = [field.name for field in fields(TokenEvent)].index("finished")  # in an event row
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


def child_main(channels: list[tuple[Connection, Connection]], engine_config: EngineConfig,
               scheduler_config: SchedulerConfig, settings: ChildSettings) -> None:
    """The process's entry point (multiprocessing "spawn"): `channels` is (commands, replies) per client."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    try:
        core = _build(engine_config, scheduler_config, settings)
    except BaseException as exc:
        if not isinstance(exc, (MetronomeError, ValueError)):
            log.exception("the engine could not start")  # an unexpected error: its traceback lives only here
        channels[0][1].send((FAILED, portable(exc)))
        return
    try:
        channels[0][1].send((READY, ReadyInfo(
            os.getpid(), core.model_name, core.vocab_size, core.max_model_len, core.config.max_waiting,
            core.block_manager.max_admissible_tokens(), tuple(sorted(core.eos_token_ids)), core.stats(),
            core.startup_summary(), core.runner.device.type, core.config.tensor_parallel_size, core.tokenizer)))
        freeze_startup_heap()  # as `serve` does in-process
        _Loop(core, channels, parent).run()
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
    def __init__(self, core, channels: list[tuple[Connection, Connection]], parent: int):
        self.core = core
        self.clients: list[tuple[Connection, Connection] | None] = list(channels)  # None once detached
        self.multi = len(channels) > 1
        self.owners: dict[str, tuple[int, str]] = {}  # with several clients: core id -> (client, its id)
        self.parent = parent
        self.acked = [0] * len(channels)  # per client: seq of the last command applied
        self.applied = False  # commands were applied since the last message
        self.stopped = False  # every client is gone

    def run(self) -> None:
        core = self.core
        while True:
            if not self._receive(0.0 if core.has_unfinished() else IDLE_POLL_S) or self.stopped:
                return
            if not core.has_unfinished():
                if self.applied:  # an idle engine's new state (a reconfiguration, an abort) still shows
                    self._send_all([], [], None)
                continue
            try:
                events, step_stats = core.step()
            except Exception as exc:  # keep serving: fail the requests in flight, not the process
                log.exception("engine step failed")
                failure = portable(exc)
                self._send_all([], [(request_id, failure) for request_id in core.abort_all()], None)
                continue
            failures = [(request_id, portable(exc)) for request_id, exc in core.take_failures()]
            self._send_all([tuple(event.__dict__.values()) for event in events], failures, step_stats)

    def _receive(self, timeout: float) -> bool:
        """Apply every command that has arrived, waiting up to `timeout` for the first; False when no client is
        left or the API process is gone."""
        live = [channel[0] for channel in self.clients if channel is not None]
        if not live:
            return False
        if len(live) == 1:
            ready = live if live[0].poll(timeout) else []
        else:
            ready = wait(live, timeout) if timeout > 0 else [conn for conn in live if conn.poll(0.0)]
        if not ready:
            return os.getppid() == self.parent
        for client, channel in enumerate(self.clients):
            if channel is not None and channel[0] in ready:
                self._drain(client, channel[0])
        return any(channel is not None for channel in self.clients)

    def _drain(self, client: int, commands: Connection) -> None:
        while True:
            try:
                batch = commands.recv()
            except (EOFError, OSError):  # its API process is gone
                self._detach(client)
                return
            for command in batch:
                self._apply(client, command)
            if self.clients[client] is None or not commands.poll(0.0):
                return

    def _apply(self, client: int, command: tuple) -> None:
        kind, seq = command[0], command[1]
        self.acked[client] = seq
        self.applied = True
        core = self.core
        if kind == ADD:
            token_ids, params, request_id, arrival = command[2:]
            core_id = self._own(client, request_id)
            try:
                core.add_prepared(token_ids, params, core_id, arrival)
            except Exception as exc:  # validated in the API process, so rare (a grammar matcher that fails)
                log.exception("request %s could not be added", request_id)
                self.owners.pop(core_id, None)
                self._send(client, [], [(request_id, portable(exc))], None)
        elif kind == ABORT:  # its finished event (reason "abort") comes with the next step and ends the owner
            core.abort(f"{client}:{command[2]}" if self.multi else command[2])
        elif kind == RECONFIGURE:
            try:
                core.reconfigure(command[2])
            except Exception:
                log.exception("reconfiguration failed")
        elif kind == STOP:
            self._detach(client)

    def _own(self, client: int, request_id: str) -> str:
        if not self.multi:
            return request_id
        core_id = f"{client}:{request_id}"
        self.owners[core_id] = (client, request_id)
        return core_id

    def _detach(self, client: int) -> None:
        """The client is done (STOP) or gone (EOF): abort its requests, close its pipes; stop after the last."""
        channel = self.clients[client]
        if channel is None:
            return
        self.clients[client] = None
        # With one client the process stops now and core.close() frees everything.
        mine = [core_id for core_id, (owner, _) in self.owners.items() if owner == client] if self.multi else []
        for core_id in mine:
            self.core.abort(core_id)
            self.owners.pop(core_id, None)
        for conn in channel:
            conn.close()
        if self.multi and self.clients.count(None) < len(self.clients):
            log.info("API server %d detached (%d request(s) aborted)", client, len(mine))
        self.stopped = all(channel is None for channel in self.clients)

    def _send_all(self, rows: list[tuple], failures: list, step_stats) -> None:
        if not self.multi:
            self._send(0, rows, failures, step_stats)
            return
        count = len(self.clients)
        rows_of: list[list] = [[] for _ in range(count)]
        failures_of: list[list] = [[] for _ in range(count)]
        owners = self.owners
        for row in rows:
            owner = owners.get(row[0])
            if owner is not None:
                rows_of[owner[0]].append((owner[1], *row[1:]))
                if row[FINISHED]:
                    del owners[row[0]]
        for core_id, exc in failures:
            owner = owners.pop(core_id, None)
            if owner is not None:
                failures_of[owner[0]].append((owner[1], exc))
        for client in range(count):
            if self.clients[client] is not None:
                self._send(client, rows_of[client], failures_of[client], step_stats if client == 0 else None)
        self.applied = False

    def _send(self, client: int, rows: list[tuple], failures: list, step_stats) -> None:
        channel = self.clients[client]
        if channel is None:
            return
        message = (rows, failures, step_stats, self.core.stats(), self.acked[client])
        if not self.multi:  # one client: its API process gone means nobody to serve (run() ends)
            channel[1].send(message)
        else:
            try:
                channel[1].send(message)
            except OSError:  # that API process is gone; the others go on
                self._detach(client)
        self.applied = False

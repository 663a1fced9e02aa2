"""`metronome serve`: the OpenAI-compatible streaming server.

Scheduler flags give the initial values; the --config file's `scheduler` section overrides the fields it sets,
at start and on every reload. argparse only at module level: torch and friends are imported inside run().
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger("metronome.serve")


def configure(parser: argparse.ArgumentParser) -> None:
    from metronome.server.engine.flags import add_engine_flags, add_scheduler_flags

    server = parser.add_argument_group("server")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="names clients use in `model`: the first is the one responses and metrics carry, the "
                             "others are aliases; the name the model was loaded as always answers too "
                             "(default: that name)")
    server.add_argument("--strict-openai", action="store_true",
                        help="refuse request fields this server does not know with a 400 (default: log each once "
                             "and ignore it, as vLLM does)")
    server.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require `Authorization: Bearer KEY` on every route but /health, /ready, /metrics and "
                             "/version (repeatable; also METRONOME_API_KEY and --api-key-file)")
    server.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="file with API keys, one per line (a mounted Secret)")
    server.add_argument("--tool-call-parser", default="auto", choices=["auto", "qwen2", "llama3"],
                        help="how tool calls are read from the model's text: qwen2 (<tool_call> tags, also Hermes), "
                             "llama3 (a JSON message), auto (either; default)")
    server.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    server.add_argument("--config", default=None, metavar="FILE",
                        help="server.yaml to load and watch; its scheduler section is reloaded live")
    server.add_argument("--candidate-config", default=None, metavar="FILE",
                        help="with --config and --pod-labels: a second server.yaml, served instead of --config while "
                             "the pod is labelled metronome.dev/variant=candidate (an experiment's candidate slice)")
    server.add_argument("--pod-labels", default=None, metavar="FILE",
                        help="the pod's labels as the kubelet projects them (downward API metadata.labels), read at "
                             "every config poll to choose between --config and --candidate-config")
    server.add_argument("--drain-seconds", type=float, default=30.0, metavar="S",
                        help="on SIGTERM, how long in-flight requests may run before they are aborted")
    server.add_argument("--config-poll-seconds", type=float, default=0.5, metavar="S",
                        help="how often the config file is checked for new content (default: %(default)s)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--engine-process", default="auto", choices=["auto", "on", "off"],
                        help="run the engine core in a process of its own, so that HTTP work never holds the GIL "
                             "an engine step needs (auto: on when the device is cuda, or with --api-servers > 1; "
                             "default: %(default)s)")
    # Isolation between clients: see docs/server.md "Limits".
    from metronome.server.api.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_TOKENIZER_WORKERS
    from metronome.server.cli_types import positive_int

    server.add_argument("--api-servers", type=positive_int, default=1, metavar="N",
                        help="API server processes in front of the one engine process, all on --host:--port "
                             "(SO_REUSEPORT); N > 1 needs --engine-process on or auto (default: %(default)s)")

    server.add_argument("--max-request-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                        help="larger request bodies get 413 before they are read (default: %(default)s = 2 MiB)")
    server.add_argument("--tokenizer-workers", type=positive_int, default=DEFAULT_TOKENIZER_WORKERS, metavar="N",
                        help="threads that tokenize prompts and render chat templates off the event loop "
                             "(default: %(default)s)")
    server.add_argument("--max-waiting-per-client", type=positive_int, default=None, metavar="N",
                        help="while other clients have requests in flight, one client may have at most N requests "
                             "waiting for their first token (default: none beyond the fair share, --max-waiting / "
                             "active clients; a client alone may use all of --max-waiting). A client is its API key, "
                             "else the request's `user` field, else its address")
    server.add_argument("--max-running-per-client", type=positive_int, default=None, metavar="N",
                        help="the same for requests running or waiting (default: none beyond the fair share, "
                             "--max-num-seqs / active clients)")
    server.add_argument("--max-prompt-tokens-per-second-per-client", type=positive_int, default=None, metavar="R",
                        help="each client (the same identity as the shares) may send at most R prompt tokens per "
                             "second, times n choices and batch prompts; over it 429 with Retry-After. Applies to a "
                             "lone client too (default: no limit)")
    server.add_argument("--prompt-token-burst-per-client", type=positive_int, default=None, metavar="B",
                        help="the bucket of that rate: at most B tokens at once after an idle spell (default: R, one "
                             "second's worth); a request larger than B is admitted when the bucket is full and then "
                             "paid back at R")
    add_engine_flags(parser.add_argument_group("engine (fixed for the process)"))
    add_scheduler_flags(parser.add_argument_group("scheduler (initial values; the --config file overrides them)"))



def _http_stack() -> tuple[str, str]:
    """What uvicorn's "auto" picks: httptools and uvloop when installed (the server extra), else h11 and asyncio."""
    from importlib.util import find_spec

    return ("httptools" if find_spec("httptools") else "h11"), ("uvloop" if find_spec("uvloop") else "asyncio")


def run(args: argparse.Namespace) -> int:
    import logging

    from metronome.contract.errors import MetronomeError
    from metronome.server.api.config_watch import load_config, variant_files
    from metronome.server.engine.flags import engine_config_from_args, scheduler_from_args

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.api_servers > 1:
            from metronome.server.api.api_servers import check_api_servers

            check_api_servers(args.api_servers, args.engine_process)
        base = scheduler_from_args(args)  # the base that the --config file overrides
        variants = variant_files(args.config, args.candidate_config, args.pod_labels)
        served = variants.choose()[1] if variants is not None else args.config
        initial = load_config(served, base)[3] if served else base  # fail before loading the model
        engine_config = engine_config_from_args(args)
        from metronome.server.api.auth import resolve_keys

        args.api_keys = resolve_keys(args.api_key, args.api_key_file)
        from metronome.server.api.client_rate import RateFlags

        args.rates = RateFlags(args.max_prompt_tokens_per_second_per_client, args.prompt_token_burst_per_client)
    except (MetronomeError, ValueError) as exc:
        print(f"metronome serve: {exc}", file=sys.stderr)
        return 2
    try:
        if args.api_servers > 1:
            from metronome.server.api.api_servers import prepare_metrics_dir, serve_many

            return serve_many(args, engine_config, base, initial, prepare_metrics_dir())
        return _serve(args, engine_config, base, initial)
    except (MetronomeError, ValueError) as exc:
        print(f"metronome serve: {exc}", file=sys.stderr)
        return 2


def cpu_engine_threads(cpus: int) -> int:
    """Torch threads for an engine on the CPU: all cores but one, which the event loop and the tokenizer workers
    need. With every core in torch's OpenMP team, any request work on the event loop preempts a team member and
    the others spin at the next barrier: on 2 vCPUs a burst of 64 small requests stretched 4-token decode steps
    from ~2 ms to 120-200 ms (the engine's TBT p99 150 ms; under 10 ms with one thread, docs/perf/isolation.md)."""
    return max(1, cpus - 1)


def _load_engine(build, engine_config, initial):
    """build(engine_config, initial) with a live status line on a terminal (rich), then log how long it took."""
    import time

    from rich.console import Console

    console = Console(stderr=True)
    started = time.perf_counter()
    if console.is_terminal:
        with console.status(f"loading {engine_config.model or 'the default model'} "
                            f"({engine_config.dtype}, {engine_config.device}) ..."):
            built = build(engine_config, initial)
    else:
        built = build(engine_config, initial)
    log.info("engine ready in %.1fs", time.perf_counter() - started)
    return built


def _stall_loggers(device_type: str) -> list:
    """On a GPU a step over 100 ms is a stall worth a log line (slow_steps.py); on a CPU such steps are work."""
    from metronome.server.engine.slow_steps import SlowStepLog

    return [SlowStepLog()] if device_type == "cuda" else []


def _build_engine(mode: str, engine_config, initial, clients: int = 1):
    """(engine, device type): the core in a process of its own (ProcessEngine) or on a thread of this one
    (AsyncEngine), as --engine-process `mode` says; with `clients` > 1 API servers always the former. On the CPU
    the engine gets all cores but one either way: in its own process too, the HTTP process's work preempts a
    member of a full OpenMP team (cpu_engine_threads)."""
    from functools import partial

    from metronome.server.engine.async_engine import AsyncEngine
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.engine_process import ProcessEngine, engine_process_mode
    from metronome.server.models.device import resolve_device

    device = engine_config.device  # an explicit device needs no torch here: its import would delay the engine's
    device_type = device if device == "cpu" else "cuda" if device.startswith("cuda") else \
        resolve_device(device, check_available=False).type
    own_process, why = engine_process_mode(mode, device_type)
    if clients > 1:  # run() refused "off"
        own_process, why = True, f"{why}, {clients} API servers"
    cpu_threads = None
    if engine_config.tensor_parallel_size == 1 and "OMP_NUM_THREADS" not in os.environ:
        cpu_threads = cpu_engine_threads(len(os.sched_getaffinity(0)))
    if own_process:
        engine = _load_engine(partial(ProcessEngine.launch, cpu_threads=cpu_threads, clients=clients), engine_config,
                              initial)
        log.info("engine core in process %d (%s)", engine.pid, why)
        return engine, engine.info.device_type
    core = _load_engine(EngineCore.from_config, engine_config, initial)
    log.info("engine core on a thread of this process (%s)", why)
    device_type = core.runner.device.type
    if device_type == "cpu" and cpu_threads is not None:
        import torch

        torch.set_num_threads(cpu_threads)
        log.info("CPU engine: %d torch thread(s), one core left for HTTP (set OMP_NUM_THREADS to choose)",
                 cpu_threads)
    return AsyncEngine(core), device_type


def _serve(args: argparse.Namespace, engine_config, base, initial) -> int:
    import uvicorn
    from prometheus_client import disable_created_metrics

    from metronome.server.api.app import create_app
    from metronome.server.api.client_share import ShareFlags
    from metronome.server.api.lifecycle import make_draining_server
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import build_state
    from metronome.server.engine.serving_process import freeze_startup_heap, shorten_gil_switch

    disable_created_metrics()  # `_created` series only add noise to every scrape
    engine, device_type = _build_engine(args.engine_process, engine_config, initial)
    names = args.served_model_name or [engine.model_name]
    served_name = names[0]
    metrics = ServerMetrics(served_name)
    engine.observers = [metrics, *_stall_loggers(device_type)]
    state = build_state(engine, metrics, served_name, base, config_file=args.config,
                        poll_interval_s=args.config_poll_seconds, candidate_config=args.candidate_config,
                        pod_labels=args.pod_labels)
    app = create_app(engine, state, max_body_bytes=args.max_request_body_bytes,
                     tokenizer_workers=args.tokenizer_workers, strict_openai=args.strict_openai,
                     api_keys=args.api_keys, aliases=tuple(names[1:]), tool_call_parser=args.tool_call_parser,
                     shares=ShareFlags(args.max_waiting_per_client, args.max_running_per_client),
                     rates=args.rates)
    log.info("serving %s on http://%s:%d (API key %s%s)", ", ".join(dict.fromkeys([*names, engine.model_name])),
             args.host, args.port, "required" if args.api_keys else "not required",
             ", strict OpenAI fields" if args.strict_openai else "")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                            timeout_graceful_shutdown=max(args.drain_seconds, 1.0))
    server = make_draining_server(config, state.lifecycle, args.drain_seconds, engine.abort)
    log.info("HTTP: %s on %s", *_http_stack())
    # With the engine in its own process the thread that waits here is ProcessEngine's reader, which hands each
    # step's tokens to the event loop: the same holds for it.
    shorten_gil_switch(device_type)
    log.info("start-up heap frozen: %d objects the garbage collector no longer walks", freeze_startup_heap())
    server.run()
    return 0

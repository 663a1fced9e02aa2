"""`metronome serve`: the OpenAI-compatible streaming server.

Scheduler flags give the initial values; the --config file's `scheduler` section overrides the fields it sets,
at start and on every reload. argparse only at module level: torch and friends are imported inside run().
"""
from __future__ import annotations

import argparse
import sys

SCHEDULER_FLAGS = ("chunk_size", "queue_policy", "max_num_seqs", "max_num_batched_tokens")


def configure(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--model", default=None,
                        help="model source: an hf-dir path, a .gguf file, or random:<preset> (default: SmolLM2-135M)")
    server.add_argument("--served-model-name", default=None, help="name clients use in `model` (default: --model)")
    server.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    server.add_argument("--config", default=None, metavar="FILE",
                        help="server.yaml to load and watch; its scheduler section is reloaded live")
    server.add_argument("--max-waiting", type=int, default=1024, metavar="N",
                        help="bound of the waiting queue; beyond it requests get 429 (default: %(default)s)")
    server.add_argument("--drain-seconds", type=float, default=30.0, metavar="S",
                        help="on SIGTERM, how long in-flight requests may run before they are aborted")
    server.add_argument("--config-poll-seconds", type=float, default=0.5, metavar="S",
                        help="how often the config file is checked for new content (default: %(default)s)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])

    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    engine.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    engine.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    engine.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV budget on CPU")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use")
    engine.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    engine.add_argument("--attention-backend", default="auto", help="auto | torch | triton | flash_attn")
    engine.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    engine.add_argument("--seed", type=int, default=0, help="engine seed")
    engine.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard the model over N GPUs of this host (one process each); default 1")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs for decode steps (captured at start on CUDA by default)")

    scheduler = parser.add_argument_group("scheduler (initial values; the --config file overrides them)")
    scheduler.add_argument("--chunk-size", type=int, default=None, help="prefill tokens per step")
    scheduler.add_argument("--queue-policy", default=None, choices=["fcfs", "split", "sjf"])
    scheduler.add_argument("--max-num-seqs", type=int, default=None, help="most sequences running at once")
    scheduler.add_argument("--max-num-batched-tokens", type=int, default=None, help="hard cap on tokens per step")


def scheduler_from_flags(args: argparse.Namespace):
    from metronome.contract.config import validate_scheduler

    given = {name: getattr(args, name) for name in SCHEDULER_FLAGS if getattr(args, name, None) is not None}
    return validate_scheduler(given, source="command line")


def engine_config_from_flags(args: argparse.Namespace):
    from metronome.server.engine.config import EngineConfig

    config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_gb=args.kv_cache_memory_gb, enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len, max_waiting=args.max_waiting, attention_backend=args.attention_backend,
        seed=args.seed, tensor_parallel_size=args.tensor_parallel_size, cuda_graphs=not args.enforce_eager,
    )
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    import logging

    from metronome.server.api.config_watch import load_config
    from metronome.contract.errors import MetronomeError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        base = scheduler_from_flags(args)
        initial = load_config(args.config, base)[3] if args.config else base  # fail before loading the model
        engine_config = engine_config_from_flags(args)
    except (MetronomeError, ValueError) as exc:
        print(f"metronome serve: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args, engine_config, base, initial)
    except (MetronomeError, ValueError) as exc:
        print(f"metronome serve: {exc}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace, engine_config, base, initial) -> int:
    import uvicorn
    from prometheus_client import disable_created_metrics

    from metronome.server.api.app import create_app
    from metronome.server.api.lifecycle import make_draining_server
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import build_state
    from metronome.server.engine.async_engine import AsyncEngine
    from metronome.server.engine.engine import EngineCore

    disable_created_metrics()  # `_created` series only add noise to every scrape
    core = EngineCore.from_config(engine_config, initial)
    served_name = args.served_model_name or core.model_name
    metrics = ServerMetrics(served_name)
    engine = AsyncEngine(core, observers=[metrics])
    state = build_state(engine, metrics, served_name, base, config_file=args.config,
                        poll_interval_s=args.config_poll_seconds)
    app = create_app(engine, state)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                            timeout_graceful_shutdown=max(args.drain_seconds, 1.0))
    server = make_draining_server(config, state.lifecycle, args.drain_seconds, engine.abort)
    server.run()
    return 0

"""The mixed step on the GPU: `--decodes` running decodes at `--context` tokens plus one `--chunk`-token prompt
chunk, timed per forward mode in one run, the modes interleaved request by request (eager timings drift with the
host CPU, so only ratios within a run are compared), against its floor.

    python3 -m hack.profile_mixed --out mixed.json [--profile]      # on the GPU machine, from the repo root
    python hack/profile_mixed.py --smoke --out /tmp/mixed.json       # the plumbing, on the CPU

Modes: `piecewise` (piecewise CUDA graphs, fused kernels), `eager` (fused kernels, no graphs) and
`eager_unfused` (the torch element-wise ops, no graphs: the path before fusion). Each chunk request has a prompt
of 4 chunks (contexts 0, 1, 2, 3 chunks) and one output token, so every timed step carries exactly one chunk.
Floor = max(FLOPs / measured matmul peak, bytes / measured copy bandwidth); bytes = weights + the KV read.
With --profile, one step per mode under torch.profiler: host launch calls, GPU kernels and GPU-busy time.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

MODES = ("piecewise", "eager", "eager_unfused")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
                "cudaMemcpyAsync")


def set_mode(core, mode: str, pieces) -> None:
    core.runner.pieces = pieces if mode == "piecewise" else None
    core.runner.model.fused = False if mode == "eager_unfused" else None


def profile_step(core, torch) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        _, stats = core.step()
        torch.cuda.synchronize()
    launches: dict[str, int] = {}
    kernels, busy_us = 0, 0.0
    for event in prof.events():
        if event.name in LAUNCH_CALLS:
            launches[event.name] = launches.get(event.name, 0) + 1
        if str(getattr(event, "device_type", "")).endswith("CUDA") and getattr(event, "device_time", 0) > 0:
            kernels += 1
            busy_us += event.device_time
    return {"host_launch_calls": launches, "host_launches": sum(v for k, v in launches.items()
                                                                if k != "cudaMemcpyAsync"),
            "gpu_kernels": kernels, "gpu_busy_ms": busy_us / 1000, "forward": stats.forward,
            "num_tokens": stats.num_tokens}


def mixed_floor(config, decodes: int, context: int, chunk: int, chunk_start: int, peaks: dict, dtype_bytes: int):
    from metronome.server.bench.engine import model_math

    layers, heads, d = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    tokens = decodes + chunk
    linear = 2.0 * model_math.active_linear_params(config) * tokens
    pairs = decodes * context + sum(chunk_start + i + 1 for i in range(chunk))  # (query, key) pairs per layer
    attention = 4.0 * layers * heads * d * pairs
    lm_head = 2.0 * config.vocab_size * config.hidden_size * (decodes + 1)
    flops = linear + attention + lm_head
    kv = model_math.kv_bytes_per_token(config, dtype_bytes)
    nbytes = model_math.weights_read_per_decode_step(config, dtype_bytes, tokens) + kv * (decodes * context
                                                                                  + chunk_start + chunk)
    compute_s = flops / (peaks["matmul_tflops"] * 1e12)
    memory_s = nbytes / (peaks["bandwidth_gb_per_s"] * 1e9)
    return {"flops": flops, "bytes": nbytes, "compute_ms": compute_s * 1e3, "memory_ms": memory_s * 1e3,
            "floor_ms": max(compute_s, memory_s) * 1e3, "bound": "compute" if compute_s > memory_s else "memory"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3, help="chunk requests per mode (4 timed steps each)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="random:tiny on the CPU, small sizes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    from metronome.contract.config import SchedulerConfig
    from metronome.server.bench.engine.device_peaks import device_section
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.sampling import SamplingParams

    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model, args.decodes, args.context, args.chunk, args.reps = "random:tiny", 3, 40, 16, 1
    start = time.perf_counter()
    config = EngineConfig(model=args.model, device=device, attention_backend="auto" if not args.smoke else "torch",
                          num_kv_blocks=None if not args.smoke else 512, seed=0,
                          async_scheduling="off")  # a profiled step() must run and read one step, not two
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=8192, max_num_seqs=args.decodes + 1,
                                                          queue_policy="fcfs"))
    startup_s = time.perf_counter() - start
    pieces = core.runner.pieces
    if args.smoke:  # no CUDA graphs on the CPU: the recorded stand-in, to exercise the same path
        from metronome.server.engine.cuda_graphs import capture_recorded
        pieces = core.runner.piecewise_runner([32, 64], capture_recorded)
        pieces.capture_all()
    result: dict = {"model": args.model, "decodes": args.decodes, "context": args.context, "chunk": args.chunk,
                    "execution_mode": core.execution_mode, "startup_s": startup_s,
                    "graph_capture_s": core.runner.graph_capture_s}
    print(f"engine ready in {startup_s:.1f} s ({core.execution_mode}); capture {core.runner.graph_capture_s}",
          flush=True)
    peaks = device_section(torch.device(device), 2048 if not args.smoke else 4, 8192 if not args.smoke else 64, 10)
    result["device"] = {k: peaks[k] for k in ("bandwidth_gb_per_s", "matmul_tflops")}

    rng = random.Random(0)
    vocab = core.vocab_size
    decode_params = SamplingParams(max_tokens=10_000 if not args.smoke else 200, temperature=0.0, ignore_eos=True)
    max_tokens = min(core.max_model_len - args.context - 1, decode_params.max_tokens)
    decode_params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    decoding = {core.add_request([rng.randrange(3, vocab) for _ in range(args.context)], decode_params)
                for _ in range(args.decodes)}
    started: set[str] = set()
    while started != decoding:  # every decode has its first token: the whole batch is past its prefill
        events, _ = core.step()
        started.update(e.request_id for e in events if e.token_id >= 0)
    core.reconfigure(SchedulerConfig(chunk_size=args.chunk, max_num_seqs=args.decodes + 1, queue_policy="fcfs"))
    for _ in range(3):
        _, stats = core.step()
    if stats.num_decode_tokens != args.decodes or stats.num_prefill_tokens:
        raise SystemExit(f"expected {args.decodes} running decodes, got a step of {stats.num_decode_tokens} decodes "
                         f"and {stats.num_prefill_tokens} prefill tokens")

    steps = []
    chunks_per_request = 4
    for rep in range(args.reps):
        for mode in MODES:
            set_mode(core, mode, pieces)
            prompt = [rng.randrange(3, vocab) for _ in range(args.chunk * chunks_per_request)]
            core.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            for i in range(chunks_per_request):
                t0 = time.perf_counter()
                _, stats = core.step()
                wall = time.perf_counter() - t0
                steps.append({"mode": mode, "rep": rep, "chunk_start": i * args.chunk, "wall_ms": wall * 1e3,
                              "host_ms": stats.scheduler_overhead_s * 1e3, "num_tokens": stats.num_tokens,
                              "decodes": stats.num_decode_tokens, "prefill_tokens": stats.num_prefill_tokens,
                              "forward": stats.forward})
    result["steps"] = steps
    dtype_bytes = torch.empty((), dtype=core.runner.kv_caches[0][0].dtype).element_size()
    summary = {}
    for mode in MODES:
        mine = [s for s in steps if s["mode"] == mode and s["prefill_tokens"] == args.chunk
                and s["decodes"] == args.decodes]
        wall = statistics.median(s["wall_ms"] for s in mine)
        floors = [mixed_floor(core.loaded.config, args.decodes, args.context, args.chunk, s["chunk_start"],
                              result["device"], dtype_bytes)["floor_ms"] for s in mine]
        starts = sorted({s["chunk_start"] for s in mine})
        summary[mode] = {"step_ms_median": wall, "steps": len(mine), "step_ms_by_chunk_start": {
            str(c): statistics.median(s["wall_ms"] for s in mine if s["chunk_start"] == c) for c in starts},
            "host_ms_median": statistics.median(s["host_ms"] for s in mine),
            "floor_ms_mean": statistics.fmean(floors), "ratio_to_floor": wall / statistics.fmean(floors),
            "forwards": sorted({s["forward"] for s in mine})}
    base = summary["piecewise"]["step_ms_median"]
    for mode in MODES:
        summary[mode]["ratio_to_piecewise"] = summary[mode]["step_ms_median"] / base
    result["summary"] = summary
    result["floor_at_mid_chunk"] = mixed_floor(core.loaded.config, args.decodes, args.context, args.chunk,
                                               args.chunk * chunks_per_request // 2, result["device"], dtype_bytes)

    if args.profile and not args.smoke:
        profiles = {}
        for mode in MODES:
            set_mode(core, mode, pieces)
            core.add_request([rng.randrange(3, vocab) for _ in range(args.chunk * 2)],
                             SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            core.step()  # the first chunk, unprofiled (warm)
            profiles[mode] = profile_step(core, torch)  # the second chunk
        set_mode(core, "piecewise", pieces)
        while core.step()[1].num_prefill_tokens:  # the last chunk; then decode-only steps (the decode graph)
            pass
        profiles["decode_graph"] = profile_step(core, torch)
        result["profiles"] = profiles
    set_mode(core, "piecewise", pieces)
    from metronome.kernels import compile_watch
    result["kernel_compiles_after_ready"] = core.stats().kernel_compiles_after_ready
    result["kernel_compiles_total"] = compile_watch.count()  # 0 on a GPU would mean the hook is not installed
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'mode':<14} {'step ms':>8} {'host ms':>8} {'floor ms':>8} {'x floor':>7} {'x piecewise':>11}")
    for mode, s in summary.items():
        print(f"{mode:<14} {s['step_ms_median']:8.2f} {s['host_ms_median']:8.2f} {s['floor_ms_mean']:8.2f} "
              f"{s['ratio_to_floor']:7.2f} {s['ratio_to_piecewise']:11.2f}  {s['forwards']}")
    for mode, p in result.get("profiles", {}).items():
        print(f"profile {mode:<14} host launches {p['host_launches']:5d}  GPU kernels {p['gpu_kernels']:5d}  "
              f"GPU busy {p['gpu_busy_ms']:.2f} ms  ({p['forward']}, {p['num_tokens']} tokens)")
    print(f"kernel compiles after ready: {result['kernel_compiles_after_ready']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

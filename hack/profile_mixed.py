"""The mixed step on the GPU: `--decodes` running decodes at `--context` tokens plus one prompt chunk of each
`--chunks` size, with async scheduling on (the host prepares step n+1 while step n runs), each step run whole and
as two overlapped micro-batches (the engine's --mixed-overlap), the variants interleaved request by request,
against its floor.

    python3 -m hack.profile_mixed --out mixed.json [--profile]      # on the GPU machine, from the repo root
    python hack/profile_mixed.py --smoke --out /tmp/mixed.json       # the plumbing, on the CPU

Variants: `whole` (the step as one batch: piecewise CUDA graphs, attention between the pieces), `overlap` (the
step's decodes replay their decode graph on a second stream beside the chunk's piecewise graphs), `split` (the
same two parts one after the other on one stream: what the split costs without the overlap), `pipeline` (the
step's tokens cut in two halves, one's attention beside the other's pieces, layer by layer: --mixed-overlap
pipeline), `pipeline-serial` (the same halves on one stream) and `pipeline-attention-first` (the attentions' stream
of higher priority than the pieces', the other way round from the engine's). Each chunk
request has a prompt of 4 chunks (contexts 0, 1, 2, 3 chunks) and one output token, so every timed step carries
exactly one chunk. A step's time is the engine's own: from the read of the step before to its read (under async
scheduling, the period between steps; host work hidden behind the GPU is not in it). Floor = max(FLOPs /
measured matmul peak, bytes / measured copy bandwidth); bytes = weights + the KV read.
With --profile, two steps of each (chunk, variant) under torch.profiler: the sum of kernel times against the GPU's
busy time (the union of kernel intervals over both streams: their ratio is the overlap) and the wall time, with
kernel time by kind (matmul, attention, other).
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import time

VARIANTS = ("whole", "overlap", "split", "pipeline", "pipeline-serial", "pipeline-attention-first")
CHUNKS_PER_REQUEST = 4


def set_variant(core, variant: str) -> None:
    overlap, pipeline = core.runner.overlap, core.runner.pipeline
    overlap.enabled = variant in ("overlap", "split")
    overlap.concurrent = variant == "overlap"
    pipeline.enabled = variant.startswith("pipeline")
    pipeline.concurrent = variant != "pipeline-serial"
    pipeline.attention_first = variant == "pipeline-attention-first"


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


def kernel_kind(name: str) -> str:
    low = name.lower()
    if "attention" in low or "flash" in low or "fmha" in low or "merge_splits" in low:
        return "attention"
    if "gemm" in low or "xmma" in low or "cutlass" in low or "nvjet" in low or "matmul" in low:
        return "matmul"
    return "other"


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (µs in, ms out). Pure."""
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1000


def overlap_summary(kernels: list[tuple[str, float, float]], wall_ms: float, steps: int) -> dict:
    """kernels: (name, start µs, end µs) over `steps` steps on every stream. Per step: the sum of kernel times,
    the GPU's busy time (their union), the wall time; overlap = sum / busy (1: one kernel at a time). Pure."""
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, start, end in kernels:
        by_kind[kernel_kind(name)] += (end - start) / 1000
    kernel_ms = sum(by_kind.values())
    busy = union_ms([(s, e) for _, s, e in kernels])
    return {"steps": steps, "kernels": len(kernels), "kernel_ms_per_step": kernel_ms / steps,
            "gpu_busy_ms_per_step": busy / steps, "wall_ms_per_step": wall_ms / steps,
            "overlap": kernel_ms / busy if busy else None, "busy_share_of_wall": busy / wall_ms if wall_ms else None,
            "kernel_ms_per_step_by_kind": {k: v / steps for k, v in sorted(by_kind.items())}}


class Stepper:
    """core.step() under async scheduling: a call returns the stats of the step launched by the call before, so
    each launched step's variant is queued and matched with its stats when they come back."""

    def __init__(self, core):
        self.core = core
        self.launched: collections.deque = collections.deque()

    def step(self, variant: str):
        _, stats = self.core.step()
        read = self.launched.popleft() if stats.num_tokens and self.launched else None
        if self.core.in_flight:
            self.launched.append(variant)
        return stats, read


def run_request(stepper: Stepper, core, rng, chunk: int, variant: str, decodes: int, steps: list, rep: int,
                until_read: bool = True) -> None:
    """One chunk request (4 chunks, one output token) under `variant`; its chunk steps' stats into `steps`."""
    from metronome.server.engine.sampling import SamplingParams

    set_variant(core, variant)
    core.add_request([rng.randrange(3, core.vocab_size) for _ in range(chunk * CHUNKS_PER_REQUEST)],
                     SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    seen = 0
    while seen < CHUNKS_PER_REQUEST:
        stats, read = stepper.step(variant)
        if stats.num_prefill_tokens == chunk and stats.num_decode_tokens == decodes:
            steps.append({"variant": read, "chunk": chunk, "rep": rep, "chunk_start": seen * chunk,
                          "step_ms": stats.duration_s * 1e3, "host_ms": stats.scheduler_overhead_s * 1e3,
                          "num_tokens": stats.num_tokens, "forward": stats.forward})
            seen += 1


def profile_steps(stepper: Stepper, core, rng, chunk: int, variant: str, decodes: int, torch) -> dict:
    """Two steady chunk steps of one request under the profiler (the chunk's first step runs before it)."""
    from torch.profiler import ProfilerActivity, profile

    from metronome.server.engine.sampling import SamplingParams

    set_variant(core, variant)
    core.add_request([rng.randrange(3, core.vocab_size) for _ in range(chunk * CHUNKS_PER_REQUEST)],
                     SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while stepper.step(variant)[0].num_prefill_tokens != chunk:  # until the first chunk step has been read
        pass
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forwards = [stepper.step(variant)[0].forward for _ in range(2)]
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start]
    while core.has_unfinished() and any(s.num_computed_tokens < s.num_prompt_tokens
                                        for s in core.scheduler.running):
        stepper.step(variant)
    result = overlap_summary(kernels, wall_ms, 2)
    result["forwards"] = forwards
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Llama-3-8B's shapes with a context that holds four 2,048-token chunks (llama-3-8b's 8,192 does not leave the
    # one generated token a request needs).
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--chunks", default="128,512,2048", help="chunk sizes, interleaved")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--reps", type=int, default=3, help="chunk requests per (chunk, variant) (4 steps each)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="random:tiny on the CPU, small sizes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}")

    import torch

    from metronome.contract.config import SchedulerConfig
    from metronome.server.bench.engine.device_peaks import device_section
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.cuda_graphs import capture_cuda, capture_recorded
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.nano_batches import NanoPipeline
    from metronome.server.engine.sampling import SamplingParams

    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model, args.decodes, args.context, chunks, args.reps = "random:tiny", 3, 40, [16, 32], 1
        args.attention_backend = "torch"
    start = time.perf_counter()
    config = EngineConfig(model=args.model, device=device, attention_backend=args.attention_backend,
                          num_kv_blocks=None if not args.smoke else 512, seed=0, async_scheduling="on",
                          mixed_overlap="on", enable_prefix_caching=False,
                          max_model_len=None if args.smoke else 16384)
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=8192, max_num_seqs=args.decodes + 1,
                                                          queue_policy="fcfs"))
    startup_s = time.perf_counter() - start
    if args.smoke:  # no CUDA graphs on the CPU: the recorded stand-ins, to exercise the same paths
        from metronome.server.engine.cuda_graphs import GraphRunner, capture_sizes, single_class

        runner = core.runner
        graphs = GraphRunner(runner.graph_forward, capture_sizes(args.decodes + 1), runner.mirror.cols,
                             runner.scratch_block, runner.device, single_class(core.max_model_len), capture_recorded,
                             refresh_host_facts=True, layer_groups=runner.layer_groups)
        graphs.capture_all()
        runner.attach_graphs(graphs)
        pieces = runner.piecewise_runner([16, 32, 64], capture_recorded)
        pieces.capture_all()
        runner.attach_pieces(pieces)
    # Both mechanisms on one engine (the flag sets one), so that the variants interleave request by request.
    core.runner.pipeline = NanoPipeline(core.runner.device)
    if not core.runner.capture_pipeline_lane(capture_recorded if args.smoke else capture_cuda):
        if not args.smoke:  # the smoke's steps are too short to cut: its pipeline variants run whole
            raise SystemExit("the pipelined steps' graphs could not be captured")
    result: dict = {"model": args.model, "decodes": args.decodes, "context": args.context, "chunks": chunks,
                    "variants": variants, "execution_mode": core.execution_mode, "startup_s": startup_s,
                    "graph_capture_s": core.runner.graph_capture_s, "async_scheduling": core.async_scheduling,
                    "attention": core.attention_description, "command": " ".join(sys.argv)}
    print(f"engine ready in {startup_s:.1f} s ({core.execution_mode}; {core.attention_description}); "
          f"capture {core.runner.graph_capture_s}", flush=True)
    peaks = device_section(torch.device(device), 2048 if not args.smoke else 4, 8192 if not args.smoke else 64, 10)
    result["device"] = {k: peaks[k] for k in ("bandwidth_gb_per_s", "matmul_tflops")}

    rng = random.Random(0)
    decode_params = SamplingParams(max_tokens=min(core.max_model_len - args.context - 1, 10_000 if not args.smoke
                                                  else 400), temperature=0.0, ignore_eos=True)
    decoding = {core.add_request([rng.randrange(3, core.vocab_size) for _ in range(args.context)], decode_params)
                for _ in range(args.decodes)}
    started: set[str] = set()
    while started != decoding:  # every decode has its first token: the whole batch is past its prefill
        events, _ = core.step()
        started.update(e.request_id for e in events if e.token_id >= 0)
    stepper = Stepper(core)
    for _ in range(3):
        stats, _ = stepper.step("whole")
    if stats.num_decode_tokens != args.decodes or stats.num_prefill_tokens:
        raise SystemExit(f"expected {args.decodes} running decodes, got a step of {stats.num_decode_tokens} decodes "
                         f"and {stats.num_prefill_tokens} prefill tokens")

    steps: list[dict] = []
    for chunk in chunks:  # one unmeasured request per chunk size first: its shapes warm (graphs, allocator)
        core.reconfigure(SchedulerConfig(chunk_size=chunk, max_num_seqs=args.decodes + 1, queue_policy="fcfs"))
        for variant in variants:
            run_request(stepper, core, rng, chunk, variant, args.decodes, [], -1)
    for rep in range(args.reps):
        for chunk in chunks:
            core.reconfigure(SchedulerConfig(chunk_size=chunk, max_num_seqs=args.decodes + 1, queue_policy="fcfs"))
            for variant in (variants if rep % 2 == 0 else variants[::-1]):
                run_request(stepper, core, rng, chunk, variant, args.decodes, steps, rep)
    result["steps"] = steps
    dtype_bytes = torch.empty((), dtype=core.runner.kv_caches[0][0].dtype).element_size()
    summary: dict = {}
    for chunk in chunks:
        rows = {}
        for variant in variants:
            mine = [s for s in steps if s["chunk"] == chunk and s["variant"] == variant]
            if not mine:
                continue
            floors = [mixed_floor(core.loaded.config, args.decodes, args.context, chunk, s["chunk_start"],
                                  result["device"], dtype_bytes)["floor_ms"] for s in mine]
            step = statistics.median(s["step_ms"] for s in mine)
            rows[variant] = {"step_ms_median": step, "steps": len(mine), "floor_ms_mean": statistics.fmean(floors),
                             "ratio_to_floor": step / statistics.fmean(floors),
                             "host_ms_median": statistics.median(s["host_ms"] for s in mine),
                             "forwards": sorted({s["forward"] for s in mine})}
        if "whole" in rows:
            for row in rows.values():
                row["ratio_to_whole"] = row["step_ms_median"] / rows["whole"]["step_ms_median"]
        summary[str(chunk)] = rows
    result["summary"] = summary
    result["floor_at_mid_chunk"] = {str(c): mixed_floor(core.loaded.config, args.decodes, args.context, c,
                                                        c * CHUNKS_PER_REQUEST // 2, result["device"], dtype_bytes)
                                    for c in chunks}

    if args.profile and not args.smoke:
        profiles: dict = {}
        for chunk in chunks:
            core.reconfigure(SchedulerConfig(chunk_size=chunk, max_num_seqs=args.decodes + 1, queue_policy="fcfs"))
            profiles[str(chunk)] = {v: profile_steps(stepper, core, rng, chunk, v, args.decodes, torch)
                                    for v in variants}
        result["profiles"] = profiles
    from metronome.kernels import compile_watch
    result["kernel_compiles_after_ready"] = core.stats().kernel_compiles_after_ready
    result["kernel_compiles_total"] = compile_watch.count()  # 0 on a GPU would mean the hook is not installed
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'chunk':>5} {'variant':<8} {'step ms':>8} {'floor ms':>8} {'x floor':>7} {'x whole':>7}  forwards")
    for chunk, rows in summary.items():
        for variant, s in rows.items():
            print(f"{chunk:>5} {variant:<8} {s['step_ms_median']:8.2f} {s['floor_ms_mean']:8.2f} "
                  f"{s['ratio_to_floor']:7.2f} {s.get('ratio_to_whole', float('nan')):7.2f}  {s['forwards']}")
    for chunk, by_variant in result.get("profiles", {}).items():
        for variant, p in by_variant.items():
            kinds = " ".join(f"{k} {v:.2f}" for k, v in p["kernel_ms_per_step_by_kind"].items())
            print(f"profile {chunk:>5} {variant:<8} kernels {p['kernel_ms_per_step']:.2f} ms  busy "
                  f"{p['gpu_busy_ms_per_step']:.2f} ms  wall {p['wall_ms_per_step']:.2f} ms  overlap "
                  f"{p['overlap']:.2f}  ({kinds})")
    print(f"kernel compiles after ready: {result['kernel_compiles_after_ready']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the saturation run's prefill phase goes: its steps (a prompt chunk beside a growing decode batch) timed
as the engine runs them, and their kernels by kind and by name.

    python3 -m hack.profile_prefill --out prefill-profile.json      # on the GPU machine, from the repo root
    python -m hack.profile_prefill --smoke --out /tmp/prefill.json   # the plumbing, on the CPU

`--requests` prompts of `--prompt-len` tokens, each generating `--output-len` tokens, all submitted at once at
chunk `--chunk` (as `bench engine --sections saturation`: FP8 weights and cache by default, CUDA graphs, async
scheduling). At each of `--at` (fractions of the prompts prefilled) the next `--steps` steps are timed without the
profiler (the engine's own step period: host work hidden behind the GPU is not in it), then as many under
torch.profiler: the kernels' sum per step against the measured period says how much of a step the GPU idles.
The floor of a step is its matmul FLOPs over the measured FP8 (or bf16) peak plus its KV bytes over the copy rate.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from hack.profile_decode import summarize


def step_floor_ms(config, prefill_tokens: int, decodes: int, kv_tokens: int, peaks: dict, fp8: bool,
                  kv_bytes_per_token: int) -> float:
    """Linear FLOPs of every row at the matmul peak the layers run at, plus the decodes' KV bytes at the copy rate
    (the chunk's own attention and the LM head left out: a lower bound). Pure."""
    from metronome.server.bench.engine import model_math

    flops = 2.0 * model_math.active_linear_params(config) * (prefill_tokens + decodes)
    peak = (peaks.get("fp8_matmul_tflops") if fp8 else None) or peaks["matmul_tflops"]  # no FP8 peak on a CPU
    return (flops / (peak * 1e12) + kv_tokens * kv_bytes_per_token / (peaks["bandwidth_gb_per_s"] * 1e9)) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--requests", type=int, default=921)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--at", default="0.1,0.5,0.9", help="fractions of the prompts prefilled when profiled")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="random:tiny on the CPU: the plumbing, no kernels")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fractions = sorted(float(f) for f in args.at.split(","))
    if not fractions or fractions[0] <= 0 or fractions[-1] >= 1:
        parser.error("--at: fractions strictly between 0 and 1")
    import torch
    from torch.profiler import ProfilerActivity, profile

    from metronome.contract.config import SchedulerConfig
    from metronome.server.bench.engine import model_math
    from metronome.server.bench.engine.command import byte_widths
    from metronome.server.bench.engine.device_peaks import device_section
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.sampling import SamplingParams

    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model, args.requests, args.prompt_len, args.output_len, args.chunk = "random:tiny", 12, 40, 8, 64
    config = EngineConfig(model=args.model, device=device, seed=0, enable_prefix_caching=False,
                          quantization=args.quantization or None, kv_cache_dtype=args.kv_cache_dtype,
                          num_kv_blocks=256 if args.smoke else None,
                          attention_backend="torch" if args.smoke else "auto")
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=args.chunk, max_num_seqs=args.requests,
                                                          queue_policy="fcfs"))
    peaks = device_section(torch.device(device), 4 if args.smoke else 2048, 64 if args.smoke else 8192, 10)
    model_config = core.loaded.config
    kv_bytes = model_math.kv_bytes_per_token(model_config, byte_widths(core))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    ids = [core.add_request([rng.randrange(3, core.vocab_size) for _ in range(args.prompt_len)], params)
           for _ in range(args.requests)]
    generated = dict.fromkeys(ids, 0)
    total_prompt = args.requests * args.prompt_len
    prefilled = 0
    result: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv),
                    "model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                    "requests": args.requests, "prompt_len": args.prompt_len, "chunk": args.chunk,
                    "device": device if args.smoke else torch.cuda.get_device_name(),
                    "peaks": {k: peaks.get(k) for k in ("bandwidth_gb_per_s", "matmul_tflops", "fp8_matmul_tflops")},
                    "execution_mode": core.execution_mode, "points": []}

    def step() -> tuple[float, object, int]:
        """One engine step: its period, stats and the KV tokens its decodes read."""
        nonlocal prefilled
        t0 = time.perf_counter()
        events, stats = core.step()
        seconds = time.perf_counter() - t0
        kv = 0
        for event in events:
            if event.token_id >= 0 and event.request_id in generated:
                kv += args.prompt_len + generated[event.request_id] if generated[event.request_id] else 0
                generated[event.request_id] += 1
        prefilled += stats.num_prefill_tokens
        return seconds, stats, kv

    for fraction in fractions:
        while prefilled < fraction * total_prompt:
            step()
        timed = [step() for _ in range(args.steps)]
        sync()
        with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
            profiled = [step() for _ in range(args.steps)]
            sync()
        kernels = [(e.name, e.time_range.end - e.time_range.start) for e in prof.events()
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start]
        summary = summarize(kernels, args.steps, args.top)
        rows = timed + profiled
        floors = [step_floor_ms(model_config, s.num_prefill_tokens, s.num_decode_tokens, kv, peaks,
                                bool(args.quantization), kv_bytes) for _, s, kv in rows]
        point = {"prefilled_fraction": fraction, "step_ms": [t * 1e3 for t, _, _ in timed],
                 "step_ms_median": statistics.median(t * 1e3 for t, _, _ in timed),
                 "prefill_tokens": [s.num_prefill_tokens for _, s, _ in rows],
                 "decodes": [s.num_decode_tokens for _, s, _ in rows], "forward": [s.forward for _, s, _ in rows],
                 "floor_ms_mean": statistics.fmean(floors), **summary}
        point["ratio_to_floor"] = point["step_ms_median"] / point["floor_ms_mean"]
        point["kernel_share_of_step"] = point["kernel_ms_per_step"] / point["step_ms_median"]
        result["points"].append(point)
        kinds = " ".join(f"{k} {v:.2f}" for k, v in summary["by_kind_ms"].items())
        print(f"at {fraction:.2f}: step {point['step_ms_median']:.1f} ms (floor {point['floor_ms_mean']:.1f}, "
              f"{point['ratio_to_floor']:.2f}x), kernels {summary['kernel_ms_per_step']:.1f} ms | {kinds} | "
              f"{point['prefill_tokens']} prefill, {point['decodes']} decodes, {sorted(set(point['forward']))}",
              flush=True)
        for row in summary["top"]:
            print(f"    {row['ms_per_step']:7.3f} ms x{row['launches_per_step']:4.0f} {row['name'][:100]}")
    core.abort_all()
    while core.has_unfinished():
        core.step()
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

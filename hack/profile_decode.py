"""Where a decode step's GPU time goes: kernel time per step by kind and by kernel, for each FP8 GEMM path, at
each batch size, against the step's bytes floor.

    python3 -m hack.profile_decode --out decode-profile.json        # on the GPU machine, from the repo root

One engine (eager: the kernels are the graphs' kernels, the profiler sees each launch), `--batches` decodes at
`--context` tokens, FP8 weights (`--quantization`) and KV (`--kv-cache-dtype`) by default. Per (batch, GEMM path)
three decode steps under torch.profiler; the GEMM path is switched on every Fp8Linear between profiles, so the
paths share one model and one KV cache. The sum of kernel times per step is what a graph replay of the step costs
at least (host time hidden); the floor is the step's bytes (weights + KV read) over the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time

KINDS = (("attention", ("attention", "merge_splits")),
         ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "skinny", "sm90", "cublas")),
         ("quantize", ("quantize", "fp8")),
         ("norm_act_rope", ("rms_norm", "silu", "gated", "rope", "norm")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(needle in low for needle in needles):
            return kind
    return "other"


def summarize(kernels: list[tuple[str, float]], steps: int, top: int = 12) -> dict:
    """kernels: (name, µs). Per step: total, by kind, the `top` kernels by time. Pure."""
    by_name: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for name, us in kernels:
        by_name[name] += us
        counts[name] += 1
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, us in by_name.items():
        by_kind[kind_of(name)] += us
    ranked = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {"kernel_ms_per_step": sum(by_name.values()) / steps / 1e3,
            "by_kind_ms": {k: v / steps / 1e3 for k, v in sorted(by_kind.items())},
            "top": [{"name": name[:120], "ms_per_step": us / steps / 1e3, "launches_per_step": counts[name] / steps}
                    for name, us in ranked]}


def set_gemm(model, gemm: str) -> int:
    from metronome.server.models.quant.fp8_linear import Fp8Linear

    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.gemm = gemm
    return len(layers)


def profile_steps(core, steps: int, torch) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        core.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            core.step()
        sync()
    return [(e.name, e.time_range.end - e.time_range.start) for e in prof.events()
            if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--gemms", default="skinny,rowwise", help="FP8 GEMM paths to profile (cuda_gemm.GEMMS)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="random:tiny on the CPU: the plumbing, no kernels")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch

    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model, args.batches, args.context = "random:tiny", "1,3", 40

    from metronome.contract.config import SchedulerConfig
    from metronome.server.bench.engine import model_math
    from metronome.server.bench.engine.command import byte_widths
    from metronome.server.bench.engine.device_peaks import device_section
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.sampling import SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    gemms = args.gemms.split(",") if args.quantization else ["bf16"]
    config = EngineConfig(model=args.model, device=device, seed=0, cuda_graphs=False, async_scheduling="off",
                          enable_prefix_caching=False, quantization=args.quantization or None,
                          kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.context + 256,
                          num_kv_blocks=64 if args.smoke else None, attention_backend="torch" if args.smoke else "auto")
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=8192, max_num_seqs=max(batches),
                                                          queue_policy="fcfs"))
    peaks = device_section(torch.device(device), 4 if args.smoke else 2048, 64 if args.smoke else 8192, 10)
    model_config = core.loaded.config
    widths = byte_widths(core)
    result: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "command": " ".join(sys.argv), "model": args.model, "quantization": args.quantization,
                    "kv_cache_dtype": args.kv_cache_dtype, "context": args.context,
                    "device": device if args.smoke else torch.cuda.get_device_name(),
                    "bandwidth_gb_per_s": peaks["bandwidth_gb_per_s"], "runs": {}}
    rng = random.Random(0)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for batch in batches:
        ids = {core.add_request([rng.randrange(3, core.vocab_size) for _ in range(args.context)], params)
               for _ in range(batch)}
        started: set[str] = set()
        while started != ids:
            events, _ = core.step()
            started.update(e.request_id for e in events if e.token_id >= 0)
        nbytes = (model_math.weights_read_per_decode_step(model_config, widths, batch)
                  + model_math.kv_bytes_per_token(model_config, widths) * batch * args.context)
        floor_ms = nbytes / (peaks["bandwidth_gb_per_s"] * 1e9) * 1e3
        for gemm in gemms:
            if args.quantization:
                set_gemm(core.loaded.model, gemm)
            summary = summarize(profile_steps(core, args.steps, torch), args.steps)
            summary["floor_ms"] = floor_ms
            summary["ratio_to_floor"] = summary["kernel_ms_per_step"] / floor_ms
            result["runs"][f"b{batch}_{gemm}"] = summary
            kinds = " ".join(f"{k} {v:.3f}" for k, v in summary["by_kind_ms"].items())
            print(f"batch {batch:4d} {gemm:9s} kernels {summary['kernel_ms_per_step']:.3f} ms/step, floor "
                  f"{floor_ms:.3f} ({summary['ratio_to_floor']:.2f}x) | {kinds}", flush=True)
            for row in summary["top"][:8]:
                print(f"    {row['ms_per_step']:.3f} ms x{row['launches_per_step']:.0f} {row['name'][:90]}")
        core.abort_all()
        while core.has_unfinished():
            core.step()
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

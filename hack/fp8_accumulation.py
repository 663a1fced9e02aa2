"""Hopper's FP8 accumulation: the Triton FP8 GEMMs' error and time with the tensor cores' partial sums promoted to
float32 every 128 products (kernels/triton_fp8.PROMOTE_EVERY = 128) and without (the default: Triton's on sm_90,
cuBLAS's "fast accumulation"), against the exact sum of the same e4m3 codes and scales; `torch._scaled_mm`
(CUTLASS, which promotes) beside them.

    python3 -m hack.fp8_accumulation --out fp8-accumulation.json      # on the GPU machine, from the repo root

Llama-3-8B's qkv (K 4,096) and down (K 14,336) projections, per-channel weights, per-token activations: Gaussian
rows, and rows whose few outlier channels (8 of K, 100x the rest) set the token's scale, as LLM activations do.
Error: |out - exact| / |exact| over the whole output (norms), and the largest element's error over the row's
largest |exact|. Time: µs per call, CUDA graph replays over weight copies larger than L2 (fp8_gemm_bench's).
"""
from __future__ import annotations

import argparse
import json
import sys

SHAPES = {"qkv_proj": (6144, 4096), "down_proj": (4096, 14336)}
ROWS = (1, 16, 64, 1024, 2048)
OUTLIERS, OUTLIER_GAIN = 8, 100.0


def activations(m: int, k: int, outliers: bool, generator, device):
    import torch

    x = torch.randn(m, k, generator=generator, device=device)
    if outliers:
        x[:, torch.randperm(k, generator=torch.Generator().manual_seed(k))[:OUTLIERS].to(device)] *= OUTLIER_GAIN
    return x.to(torch.bfloat16)


def errors(got, exact) -> dict:
    got, exact = got.double(), exact.double()
    row_scale = exact.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    return {"rel_norm": ((got - exact).norm() / exact.norm()).item(),
            "max_over_row_max": ((got - exact).abs() / row_scale).max().item()}


def measure(rows: tuple[int, ...], reps: int, weight_mb: float, device) -> dict:
    import torch

    from hack.fp8_gemm_bench import graph_time_us
    from metronome.kernels import triton_fp8
    from metronome.kernels.triton_fp8 import fp8_matmul, quantize_fp8
    from metronome.kernels.triton_fp8_skinny import MAX_ROWS, fp8_skinny_matmul
    from metronome.server.models.quant import fp8

    bf16 = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    results: dict = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(weight_mb * 1e6 // (n * k)))
        weights = [fp8.quantize_per_channel((torch.randn(n, k, generator=g, device=device) * 0.02).to(bf16))
                   for _ in range(copies)]
        for m in rows:
            kernel = "skinny" if m <= MAX_ROWS else "triton"
            for outliers in (False, True):
                xq, xs = quantize_fp8(activations(m, k, outliers, g, device))
                gemm = fp8_skinny_matmul if kernel == "skinny" else fp8_matmul
                wq, ws = weights[0]
                exact = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).t()
                row = {"kernel": kernel}
                for label, promote in (("promoted", 128), ("unpromoted", None)):
                    triton_fp8.PROMOTE_EVERY = promote
                    row[label] = errors(gemm(xq, xs, wq, ws, bf16), exact)
                    if not outliers:  # the time does not depend on the values
                        calls = [lambda f=gemm, x=xq, s=xs, w=w: f(x, s, *w, bf16) for w in weights]
                        row[label]["us"] = graph_time_us(calls, reps)
                triton_fp8.PROMOTE_EVERY = None
                try:
                    row["scaled_mm"] = errors(torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, n),
                                                               out_dtype=bf16), exact)
                except RuntimeError as exc:  # a row count cuBLASLt / CUTLASS refuses is reported, not fatal
                    row["scaled_mm"] = f"error: {str(exc)[:160]}"
                key = f"{name} M={m} {'outliers' if outliers else 'gaussian'}"
                results[key] = row
                print(key, json.dumps(row), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--weight-mb", type=float, default=400.0, help="weight copies replayed per timing")
    args = parser.parse_args(argv)
    import torch

    from metronome.server.bench.load.results import environment

    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows = tuple(int(r) for r in args.rows.split(","))
    result = {"environment": environment(), "results": measure(rows, args.reps, args.weight_mb, "cuda")}
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

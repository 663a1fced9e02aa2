"""A decode layer's four linear steps at the smallest batches, each with the kernel that makes its input: the FP8
path (the producer quantises, the small-M FP8 GEMM) against the weight-only GEMM making the input itself
(kernels/triton_w8a16.py), and against it reading the output of a separate bf16 producer.

    python3 -m hack.bench_w8a16 --rows 1,4,16 --out w8a16.json    # on the GPU machine, from the repo root

Steps, at Llama-3-8B's shapes (`fp8` / `fused` / `apart`):
  qkv      add-RMSNorm-quantise + FP8 GEMM / add-RMSNorm in the GEMM / add-RMSNorm (bf16) + weight-only GEMM
  o        quantise + FP8 GEMM             / the weight-only GEMM on the bf16 input
  gate_up  as qkv, 28,672 rows
  down     SiLU·mul-quantise + FP8 GEMM    / SiLU·mul in the GEMM   / SiLU·mul (bf16) + weight-only GEMM
Each is timed as a CUDA graph replaying one step per weight copy, over enough copies that no step finds its weight
in L2 (fp8_gemm_bench.graph_time_us): no launch cost beyond the graph's, weights from HBM. `--tiles` times the
fused steps on other tiles too (block_n:block_k:warps:stages, comma-separated).
"""
from __future__ import annotations

import argparse
import json
import sys

from hack.fp8_gemm_bench import graph_time_us

SHAPES = {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, "plain"), "gate_up": (28672, 4096, "norm"),
          "down": (4096, 14336, "silu")}


def _steps(kind: str, w, w_scale, inputs: dict, tiles) -> dict:
    """The step's variants as zero-argument callables on one weight copy."""
    import torch

    from metronome.kernels import triton_w8a16 as w8
    from metronome.kernels.triton_fp8 import quantize_fp8
    from metronome.kernels.triton_fp8_skinny import fp8_skinny_matmul
    from metronome.kernels.triton_fused import add_rms_norm, add_rms_norm_fp8, silu_mul, silu_mul_fp8

    bf16 = torch.bfloat16
    res, delta, norm_w = inputs["residual"], inputs["delta"], inputs["norm_weight"]
    if kind == "norm":
        return {
            "fp8": lambda: fp8_skinny_matmul(*add_rms_norm_fp8(delta, res, norm_w, 1e-5), w, w_scale, bf16),
            "fused": lambda: w8.add_rms_norm_w8a16(delta, res, norm_w, 1e-5, w, w_scale, tiles=tiles),
            "apart": lambda: w8.w8a16_matmul(add_rms_norm(delta, res, norm_w, 1e-5), w, w_scale, tiles=tiles),
        }
    if kind == "plain":
        x = inputs["attention_out"]
        return {"fp8": lambda: fp8_skinny_matmul(*quantize_fp8(x), w, w_scale, bf16),
                "fused": lambda: w8.w8a16_matmul(x, w, w_scale, tiles=tiles)}
    gate_up = inputs["gate_up"]
    return {"fp8": lambda: fp8_skinny_matmul(*silu_mul_fp8(gate_up), w, w_scale, bf16),
            "fused": lambda: w8.silu_mul_w8a16(gate_up, w, w_scale, tiles=tiles),
            "apart": lambda: w8.w8a16_matmul(silu_mul(gate_up), w, w_scale, tiles=tiles)}


def measure(rows: list[int], reps: int, weight_mb: float, extra_tiles: list) -> dict:
    import torch

    from metronome.kernels.triton_attention import sm_count
    from metronome.kernels.triton_w8a16 import choose_tiles
    from metronome.server.models.quant import fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    results: dict = {}
    for name, (n, k, kind) in SHAPES.items():
        copies = max(2, int(weight_mb * 1e6 // (n * k)))
        weights = [fp8.quantize_per_channel(torch.randn(n, k, generator=g, device="cuda") * 0.02)
                   for _ in range(copies)]
        chosen = choose_tiles(n, sm_count(torch.device("cuda")))
        per_rows = {}
        for m in rows:
            hidden = 4096
            inputs = {"residual": torch.randn(m, hidden, generator=g, device="cuda").to(bf16),
                      "delta": torch.randn(m, hidden, generator=g, device="cuda").to(bf16),
                      "norm_weight": torch.ones(hidden, device="cuda", dtype=bf16),
                      "attention_out": torch.randn(m, k, generator=g, device="cuda").to(bf16),
                      "gate_up": torch.randn(m, 2 * k, generator=g, device="cuda").to(bf16)}
            row: dict = {"fp8_weight_bytes": n * k, "tiles": str(chosen)}
            labels = _steps(kind, *weights[0], inputs, chosen)
            for label in labels:
                row[label] = graph_time_us([_steps(kind, w, s, inputs, chosen)[label] for w, s in weights], reps)
            for tiles in extra_tiles:
                try:
                    row[f"fused {tiles}"] = graph_time_us([_steps(kind, w, s, inputs, tiles)["fused"]
                                                          for w, s in weights], reps)
                except Exception as exc:  # noqa: BLE001 - a tile shape that does not fit is reported, not fatal
                    row[f"fused {tiles}"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
            per_rows[str(m)] = row
            print(f"{name} M={m}: " + ", ".join(f"{key} {v:.2f}us" for key, v in row.items()
                                                 if isinstance(v, float)), flush=True)
        del weights
        torch.cuda.empty_cache()
        results[name] = {"n": n, "k": k, "input": kind, "weight_copies": copies, "by_rows": per_rows}
    return results


def main(argv: list[str] | None = None) -> int:
    from metronome.kernels.triton_fp8_skinny import SkinnyTiles

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16", help="input rows (comma-separated, at most 16)")
    parser.add_argument("--reps", type=int, default=20, help="graph replays per variant (median)")
    parser.add_argument("--weight-mb", type=float, default=400.0, help="weight copies cycled per step, in MB")
    parser.add_argument("--tiles", default="", help="more tiles for the fused steps: block_n:block_k:warps:stages,...")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        extra = [SkinnyTiles(*map(int, t.split(":"))) for t in args.tiles.split(",") if t]
    except (TypeError, ValueError):
        parser.error(f"--tiles {args.tiles!r}: give block_n:block_k:warps:stages, comma-separated")
    rows = [int(r) for r in args.rows.split(",")]
    results = {"rows": rows, "steps": measure(rows, args.reps, args.weight_mb, extra)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

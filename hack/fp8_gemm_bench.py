"""Which FP8 GEMM is fastest where: Llama-3-8B's four linear shapes at decode and prefill row counts, bf16
against every CUDA path of an Fp8Linear (quant/cuda_gemm.py), plus the cost of quantising the activation.

    python3 -m hack.fp8_gemm_bench --out fp8-gemm.json     # on the GPU machine, from the repo root

Variants per (shape, M), each timed with CUDA events (median of --reps after warm-up), GEMM only (the input is
quantised beforehand; `quantize` times that separately):
  bf16         torch F.linear on bf16 operands (the baseline)
  tensor       _scaled_mm with 0-d scales (static per-tensor activations, single-shard per-tensor weights)
  rowwise      _scaled_mm with [M, 1] x [1, N] scales (per-token activations, per-channel weights)
  tensorwise   _scaled_mm with unit scales into fp32, then the row and column scales (same layout as rowwise)
  triton       the Triton FP8 GEMM, scales after the K loop (same layout)
  block        the Triton FP8 GEMM with 128 x 128 weight blocks and per-token groups of 128
  quantize     the per-token quantisation kernel on the [M, K] input (added to every dynamic variant in serving,
               unless a fused norm or SiLU·mul produced it)
`auto_pick` names what cuda_gemm's `auto` runs for per-token layouts at that M, so a regression in its threshold
shows as a slower pick than the best.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336)}
ROWS = (1, 16, 64, 128, 256, 391, 512, 1024, 2048, 8192)


def _weights(n: int, k: int, generator, device) -> dict:
    """One bf16 weight and its FP8 forms: per tensor, per channel, 128 x 128 blocks (scales per row, as loaded)."""
    import torch

    from metronome.server.models.quant import fp8

    w = (torch.randn(n, k, generator=generator, device=device) * 0.02).to(torch.bfloat16)
    q_tensor, s_tensor = fp8.quantize_per_tensor(w)
    q_channel, s_channel = fp8.quantize_per_channel(w)
    q_block, s_block = fp8.quantize_per_block(w, (128, 128))
    return {"w": w, "q_tensor": q_tensor, "s_tensor": s_tensor, "q_channel": q_channel, "s_channel": s_channel,
            "column": s_channel.reshape(1, n).contiguous(), "q_block": q_block,
            "s_block_rows": s_block.repeat_interleave(128, dim=0)[:n].contiguous(),
            "one": torch.ones((), device=device)}


def _variants(wt: dict, x) -> dict:
    """The GEMM of each variant on input x [M, K] (bf16), as zero-argument callables; inputs quantised here."""
    import torch

    from metronome.kernels.triton_fp8 import fp8_matmul, quantize_fp8
    from metronome.server.models.quant import fp8

    bf16 = torch.bfloat16
    xq_t, xs_t = fp8.quantize_per_tensor(x)
    xq, xs = quantize_fp8(x)
    xq_g, xs_g = quantize_fp8(x, 128)

    def tensorwise():
        out = torch._scaled_mm(xq, wt["q_channel"].t(), scale_a=wt["one"], scale_b=wt["one"],
                               out_dtype=torch.float32)
        return out.mul_(xs).mul_(wt["s_channel"]).to(bf16)

    return {
        "bf16": lambda: torch.nn.functional.linear(x, wt["w"]),
        "tensor": lambda: torch._scaled_mm(xq_t, wt["q_tensor"].t(), scale_a=xs_t, scale_b=wt["s_tensor"],
                                           out_dtype=bf16),
        "rowwise": lambda: torch._scaled_mm(xq, wt["q_channel"].t(), scale_a=xs, scale_b=wt["column"],
                                            out_dtype=bf16),
        "tensorwise": tensorwise,
        "triton": lambda: fp8_matmul(xq, xs, wt["q_channel"], wt["s_channel"], bf16),
        "block": lambda: fp8_matmul(xq_g, xs_g, wt["q_block"], wt["s_block_rows"], bf16, group_k=128),
        "quantize": lambda: quantize_fp8(x),
    }


def measure(shapes: dict, rows: tuple[int, ...], reps: int, device) -> dict:
    import torch

    from metronome.server.bench.engine.device_peaks import time_op
    from metronome.server.models.quant.cuda_gemm import ROWWISE_MIN_TOKENS

    g = torch.Generator(device=device).manual_seed(0)
    results: dict = {}
    for name, (n, k) in shapes.items():
        wt = _weights(n, k, g, device)
        per_shape = {}
        for m in rows:
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
            row = {}
            for label, fn in _variants(wt, x).items():
                try:
                    row[label] = statistics.median(time_op(fn, device, reps, warmup=3)) * 1e6
                except Exception as exc:  # noqa: BLE001 - a variant the GPU or torch refuses is reported, not fatal
                    row[label] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            timed = {key: v for key, v in row.items() if isinstance(v, float) and key != "quantize"}
            dynamic = {key: timed[key] for key in ("rowwise", "tensorwise", "triton") if key in timed}
            row["best"] = min(timed, key=timed.get) if timed else None
            row["best_dynamic"] = min(dynamic, key=dynamic.get) if dynamic else None
            row["auto_pick"] = "rowwise" if m >= ROWWISE_MIN_TOKENS else "tensorwise"
            if isinstance(row.get("bf16"), float):
                row["speedup_vs_bf16"] = {key: row["bf16"] / v for key, v in timed.items() if key != "bf16"}
            per_shape[str(m)] = row
            print(f"{name} M={m}: " + ", ".join(f"{key} {v:.1f}us" for key, v in row.items()
                                                 if isinstance(v, float)), flush=True)
        results[name] = {"n": n, "k": k, "by_rows": per_shape}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("fp8_gemm_bench needs a CUDA GPU with FP8 tensor cores", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = tuple(int(r) for r in args.rows.split(","))
    doc = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "reps": args.reps,
           "unit": "microseconds per GEMM (median)", "shapes": measure(SHAPES, rows, args.reps, device)}
    with open(args.out, "w") as handle:
        json.dump(doc, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

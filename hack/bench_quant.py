"""The FP8 activation-quantising kernels on CUDA against their bytes: SiLU·mul-quantise (the whole-row kernel the
engine runs, with other warp counts and the two-pass streaming form beside it), add-RMSNorm-quantise and the row
quantiser, at Llama-3-8B widths, per row count; the plain bf16 SiLU·mul as the unquantised reference.

    python3 -m hack.bench_quant --json quant.json        # on the GPU machine, from the repo root

Times are CUDA-graph replays (triton.testing.do_bench_cudagraph); GB/s counts the bytes a kernel must move
(inputs read once, outputs written once) against the copy rate measured in the same run. Every variant's codes
and scales are checked equal to the engine's kernel first.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

HIDDEN, INTERMEDIATE = 4096, 14336


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64,921,8192", help="comma-separated token counts")
    parser.add_argument("--json", help="write every row to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_quant needs a CUDA device", file=sys.stderr)
        return 2
    from triton.testing import do_bench_cudagraph

    from hack.bench_kernels import copy_bandwidth
    from metronome.kernels import triton_fused
    from metronome.kernels.triton_fp8 import quantize_fp8, scale_buffer, ub_arg, whole_row_warps

    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth:.0f} GB/s")
    rows_out: list[dict] = []

    def record(kernel: str, variant: str, rows: int, nbytes: int, fn, same: bool | None = None) -> None:
        us = do_bench_cudagraph(fn) * 1e3
        row = {"kernel": kernel, "variant": variant, "rows": rows, "us": us, "bytes": nbytes,
               "gb_per_s": nbytes / us / 1e3, "share_of_copy": nbytes / us / 1e3 / bandwidth, "same_output": same}
        rows_out.append(row)
        print(f"{kernel:18s} {variant:22s} rows {rows:5d}: {us:8.1f} us {row['gb_per_s']:6.0f} GB/s "
              f"({row['share_of_copy']:.0%} of copy){'' if same is None else f'  same={same}'}", flush=True)

    for rows in (int(r) for r in args.rows.split(",")):
        gate_up = torch.randn(rows, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        record("silu_mul", "bf16 out", rows, gate_up.numel() * 2 + out.numel() * 2,
               lambda g=gate_up, o=out: triton_fused.silu_mul(g, out=o))
        engine_q, engine_s = triton_fused.silu_mul_fp8(gate_up)
        quant_bytes = gate_up.numel() * 2 + rows * INTERMEDIATE + rows * 4
        variants = [(f"whole row, {w} warps", 16384, w, True) for w in (whole_row_warps(INTERMEDIATE), 8, 32)]
        variants += [(f"two passes of {c}, {w} warps", c, w, False) for c, w in ((1024, 4), (2048, 8))]
        for name, chunk, warps, whole in variants:
            q = torch.empty(rows, INTERMEDIATE, dtype=torch.float8_e4m3fn, device="cuda")
            s = scale_buffer(rows, INTERMEDIATE, None, None, gate_up.device)

            def call(g=gate_up, q=q, s=s, chunk=chunk, warps=warps, whole=whole):
                triton_fused._silu_mul_fp8[(g.shape[0],)](
                    g, q, s, s, g.stride(0), q.stride(0), s.stride(0), ub_arg(None), INTERMEDIATE, CHUNK=chunk,
                    GROUP=0, STATIC=False, ROUND=True, BF16=True, WHOLE=whole, num_warps=warps)
            call()
            same = torch.equal(q.view(torch.uint8), engine_q.view(torch.uint8)) and torch.equal(s, engine_s)
            record("silu_mul_fp8", name, rows, quant_bytes, call, same)
        residual = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        x = torch.randn_like(residual)
        weight = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
        record("add_rms_norm_fp8", "engine", rows, 3 * residual.numel() * 2 + rows * HIDDEN + rows * 4,
               lambda r=residual, x=x, w=weight: triton_fused.add_rms_norm_fp8(x, r, w, 1e-5))
        record("quantize_fp8", "engine", rows, residual.numel() * 2 + rows * HIDDEN + rows * 4,
               lambda r=residual: quantize_fp8(r))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "bandwidth_gb_per_s": bandwidth,
                       "command": " ".join(sys.argv), "rows": rows_out}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

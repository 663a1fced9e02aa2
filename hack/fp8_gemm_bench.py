"""Which FP8 GEMM is fastest where: Llama-3-8B's four linear shapes at decode and prefill row counts, bf16
against every CUDA path of an Fp8Linear (quant/cuda_gemm.py), plus the cost of quantising the activation.

    python3 -m hack.fp8_gemm_bench --out fp8-gemm.json     # on the GPU machine, from the repo root

Variants per (shape, M), GEMM only (the input is quantised beforehand; `quantize` times that separately), each
timed as a CUDA graph replay of one call per weight copy, over enough copies of the weight (--weight-mb) that no
call finds its weight in L2 — the way a decode step meets its layers: no launch cost, weights from HBM. Median of
--reps replays:
  bf16         torch F.linear on bf16 operands (the baseline)
  tensor       _scaled_mm with 0-d scales (static per-tensor activations, single-shard per-tensor weights)
  rowwise      _scaled_mm with [M, 1] x [1, N] scales (per-token activations, per-channel weights)
  tensorwise   _scaled_mm with unit scales into fp32, then the row and column scales (same layout as rowwise)
  triton       the Triton FP8 GEMM, scales after the K loop (same layout)
  skinny       the Triton small-M FP8 GEMM (kernels/triton_fp8_skinny.py; M <= 64, same layout)
  block        the Triton FP8 GEMM with 128 x 128 weight blocks and per-token groups of 128
  quantize     the per-token quantisation kernel on the [M, K] input (added to every dynamic variant in serving,
               unless a fused norm or SiLU·mul produced it)
`auto_pick` names what cuda_gemm's `auto` runs for per-token layouts, so a shape where it is not the best dynamic
path shows in the table. `--skinny-sweep` also times a grid of the skinny kernel's tiles per (shape, M) and
reports the best, what `triton_fp8_skinny.choose_tiles` is chosen from. Bytes per call are reported, so each
time reads against the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

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


def _variants(wt: dict, x, skinny_tiles=None, matmul_tiles=None) -> dict:
    """The GEMM of each variant on input x [M, K] (bf16), as zero-argument callables; inputs quantised here."""
    import torch

    from metronome.kernels.triton_fp8 import fp8_matmul, quantize_fp8
    from metronome.kernels.triton_fp8_skinny import MAX_ROWS, fp8_skinny_matmul
    from metronome.server.models.quant import fp8

    bf16 = torch.bfloat16
    xq_t, xs_t = fp8.quantize_per_tensor(x)
    xq, xs = quantize_fp8(x)
    xq_g, xs_g = quantize_fp8(x, 128)

    def tensorwise():
        out = torch._scaled_mm(xq, wt["q_channel"].t(), scale_a=wt["one"], scale_b=wt["one"],
                               out_dtype=torch.float32)
        return out.mul_(xs).mul_(wt["s_channel"]).to(bf16)

    variants = {
        "bf16": lambda: torch.nn.functional.linear(x, wt["w"]),
        "tensor": lambda: torch._scaled_mm(xq_t, wt["q_tensor"].t(), scale_a=xs_t, scale_b=wt["s_tensor"],
                                           out_dtype=bf16),
        "rowwise": lambda: torch._scaled_mm(xq, wt["q_channel"].t(), scale_a=xs, scale_b=wt["column"],
                                            out_dtype=bf16),
        "tensorwise": tensorwise,
        "triton": lambda: fp8_matmul(xq, xs, wt["q_channel"], wt["s_channel"], bf16, tiles=matmul_tiles),
        "block": lambda: fp8_matmul(xq_g, xs_g, wt["q_block"], wt["s_block_rows"], bf16, group_k=128),
        "quantize": lambda: quantize_fp8(x),
    }
    if x.shape[0] <= MAX_ROWS:
        variants["skinny"] = lambda: fp8_skinny_matmul(xq, xs, wt["q_channel"], wt["s_channel"], bf16,
                                                       tiles=skinny_tiles)
    return variants


def graph_time_us(calls: list, reps: int) -> float:
    """Median µs per call of a CUDA graph replaying `calls` (one per weight copy) back to back."""
    import torch

    for fn in calls:  # compiles and warms outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for fn in calls:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / len(calls))
    return statistics.median(samples)


def sweep_tiles():
    from metronome.kernels.triton_fp8_skinny import SkinnyTiles

    plain = [SkinnyTiles(bn, bk, warps, stages) for bn in (16, 32, 64, 128) for bk in (256, 512)
             for warps, stages in ((4, 3), (4, 4), (4, 6), (8, 4))]
    # K split over two programs: twice the programs and bytes in flight for the narrow weights, whose 64-96
    # programs of one per SM leave SMs idle at decode batches
    split = [SkinnyTiles(bn, 256, 4, stages, 2) for bn, stages in ((64, 4), (64, 6), (128, 3), (32, 6))]
    return plain + split


def matmul_sweep_tiles():
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the Triton FP8 GEMM worth trying above the skinny rows."""
    return [(bm, bn, warps, stages) for bm, bn in ((64, 128), (128, 128), (128, 256), (64, 256))
            for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4), (8, 5))]


def best_of(tried: dict) -> tuple[str | None, float | None]:
    timed = {key: v for key, v in tried.items() if isinstance(v, float)}
    if not timed:
        return None, None
    key = min(timed, key=timed.get)
    return key, timed[key]


def measure(shapes: dict, rows: tuple[int, ...], reps: int, device, weight_mb: float, sweep: bool,
            matmul_sweep: bool = False, only: list[str] | None = None) -> dict:
    import torch

    from metronome.server.models.quant.cuda_gemm import per_token_path

    g = torch.Generator(device=device).manual_seed(0)
    results: dict = {}
    for name, (n, k) in shapes.items():
        copies = max(2, int(weight_mb * 1e6 // (n * k)))
        weights = [_weights(n, k, g, device) for _ in range(copies)]
        per_shape = {}
        for m in rows:
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
            per_copy = [_variants(wt, x) for wt in weights]
            row: dict = {"fp8_weight_bytes": n * k, "bf16_weight_bytes": 2 * n * k}
            for label in per_copy[0]:
                if only and label not in only:
                    continue
                try:
                    row[label] = graph_time_us([v[label] for v in per_copy], reps)
                except Exception as exc:  # noqa: BLE001 - a variant the GPU or torch refuses is reported, not fatal
                    row[label] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            if sweep and "skinny" in row:
                tried = {}
                for tiles in sweep_tiles():
                    try:
                        tried[str(tiles)] = graph_time_us([_variants(wt, x, tiles)["skinny"] for wt in weights], reps)
                    except Exception as exc:  # noqa: BLE001 - a tile shape that does not fit is skipped
                        tried[str(tiles)] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
                row["skinny_sweep"] = tried
                row["skinny_best_tiles"], row["skinny_best"] = best_of(tried)
            if matmul_sweep and m > 64:
                tried = {}
                for tiles in matmul_sweep_tiles():
                    try:
                        tried[str(tiles)] = graph_time_us([_variants(wt, x, matmul_tiles=tiles)["triton"]
                                                           for wt in weights], reps)
                    except Exception as exc:  # noqa: BLE001 - a tile shape that does not fit is skipped
                        tried[str(tiles)] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
                row["triton_sweep"] = tried
                row["triton_best_tiles"], row["triton_best"] = best_of(tried)
            timed = {key: v for key, v in row.items() if isinstance(v, float) and key not in ("quantize",
                                                                                          "skinny_best", "triton_best")}
            dynamic = {key: timed[key] for key in ("rowwise", "tensorwise", "triton", "skinny") if key in timed}
            row["best"] = min(timed, key=timed.get) if timed else None
            row["best_dynamic"] = min(dynamic, key=dynamic.get) if dynamic else None
            row["auto_pick"] = per_token_path("auto", m)
            if isinstance(row.get("bf16"), float):
                row["speedup_vs_bf16"] = {key: row["bf16"] / v for key, v in timed.items() if key != "bf16"}
            per_shape[str(m)] = row
            print(f"{name} M={m}: " + ", ".join(f"{key} {v:.1f}us" for key, v in row.items()
                                                 if isinstance(v, float) and not key.endswith("bytes"))
                  + (f" | best tiles {row.get('skinny_best_tiles')}" if sweep else "")
                  + (f" | triton best {row.get('triton_best_tiles')}" if row.get("triton_best_tiles") else ""),
                  flush=True)
        del weights
        torch.cuda.empty_cache()
        results[name] = {"n": n, "k": k, "weight_copies": copies, "by_rows": per_shape}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    parser.add_argument("--weight-mb", type=float, default=400.0,
                        help="FP8 weight megabytes per timed graph (copies of the weight; L2 is 60 MB)")
    parser.add_argument("--skinny-sweep", action="store_true", help="time a grid of the skinny kernel's tiles")
    parser.add_argument("--matmul-sweep", action="store_true",
                        help="time a grid of the Triton FP8 GEMM's tiles at every M above the skinny rows")
    parser.add_argument("--variants", help="comma-separated variants to time (default: all)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("fp8_gemm_bench needs a CUDA GPU with FP8 tensor cores", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = tuple(int(r) for r in args.rows.split(","))
    from metronome.server.bench.engine.device_peaks import device_section

    peaks = device_section(device, 2048, 8192, 10)
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "reps": args.reps,
           "bandwidth_gb_per_s": peaks["bandwidth_gb_per_s"], "command": " ".join(sys.argv),
           "unit": "microseconds per GEMM (median of graph replays, weights from HBM)",
           "shapes": measure(SHAPES, rows, args.reps, device, args.weight_mb, args.skinny_sweep, args.matmul_sweep,
                             args.variants.split(",") if args.variants else None)}
    with open(args.out, "w") as handle:
        json.dump(doc, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

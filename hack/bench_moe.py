"""Microbenchmark of the MoE expert paths on CUDA, run on the GPU machine from the repo root:

    python3 -m hack.bench_moe [--sweep] [--models NAMES] [--tokens N,...] [--json rows.json]

One layer's routed experts at real shapes — qwen3-30b-a3b (128 experts, top-8, hidden 2048, expert 768),
gpt-oss-20b (32 experts, top-4, 2880, 2880, biases and the clamped SwiGLU) and mixtral-8x7b (8 experts, top-2,
4096, 14336) — in bf16, at T tokens per step (1, 64 and 256 decodes; 2048 for a prefill chunk), on three paths:

- `triton`: the fused kernels (kernels/triton_moe.py), replayed in a CUDA graph as a server runs them;
- `grouped_mm`: torch's grouped GEMM (models/moe_experts.py), replayed in a CUDA graph;
- `naive`: the reference loop over the experts any token picked (eager only: it reads the routing on the host).

Each timed call runs ROUTINGS different uniform-random routings back to back (the experts a batch touches change
from step to step, as over a model's layers, so a replay does not find its weights in L2); times are per routing.
Reported per row: microseconds, the bytes of the experts the routings touched (distinct experts x one expert's
matrices, plus activations) over the time next to the measured copy bandwidth, TFLOP/s, and the speed-up over
naive. Before timing, each path's output is compared with naive's (max error relative to the output's largest
value). `--fp8` stores the experts in e4m3 with a scale per output row (an FP8 checkpoint's experts, W8A16 in the
fused kernels; naive runs on the same weights dequantised, grouped_mm is left out); the bytes then count one byte
a weight. `--sweep` also times a grid of Triton tile configs per case (for a few tokens: one row block a pair
against 16-row blocks, narrow and deep tiles); `--models` and `--tokens` narrow the run;
`--smoke` runs tiny shapes on the CPU under Triton's interpreter (TRITON_INTERPRET=1): the plumbing, not speed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

ROUTINGS = 4


@dataclass(frozen=True)
class MoeShape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    gpt_oss: bool = False


SHAPES = [MoeShape("qwen3-30b-a3b", 128, 8, 2048, 768), MoeShape("gpt-oss-20b", 32, 4, 2880, 2880, gpt_oss=True),
          MoeShape("mixtral-8x7b", 8, 2, 4096, 14336)]
TOKENS = (1, 64, 256, 2048)
SMOKE_SHAPES = [MoeShape("tiny-qwen3", 8, 3, 32, 16), MoeShape("tiny-gpt-oss", 4, 2, 32, 32, gpt_oss=True)]
SMOKE_TOKENS = (1, 5)


class _Timer:
    """CUDA: graph replay (do_bench_cudagraph) and eager launches (do_bench, L2 flushed); elsewhere wall time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def graphed(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench_cudagraph
            return do_bench_cudagraph(fn)
        return self.eager(fn)

    def eager(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench
            return do_bench(fn)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


def _spec(shape: MoeShape):
    from metronome.server.models.moe_config import MoeSpec

    if shape.gpt_oss:
        return MoeSpec(shape.num_experts, shape.top_k, shape.inter, topk_before_softmax=True,
                       weights_in_model_dtype=True, router_bias=True, expert_bias=True, activation="swiglu_clamped",
                       checkpoint_layout="interleaved_transposed")
    return MoeSpec(shape.num_experts, shape.top_k, shape.inter, weights_in_model_dtype=True)


def _weights(shape: MoeShape, device, dtype):
    from metronome.server.models.moe_experts import ExpertWeights

    g = torch.Generator(device=device).manual_seed(0)
    e, h, i = shape.num_experts, shape.hidden, shape.inter

    def randn(*size, std):
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    bias = shape.gpt_oss
    return ExpertWeights(randn(e, 2 * i, h, std=0.02), randn(e, h, i, std=0.02),
                         randn(e, 2 * i, std=0.02) if bias else None, randn(e, h, std=0.02) if bias else None)


def _routings(shape: MoeShape, tokens: int, device, dtype):
    """ROUTINGS (x, weights, ids) with every token picking top_k distinct experts uniformly at random."""
    g = torch.Generator(device=device).manual_seed(tokens)
    out = []
    for _ in range(ROUTINGS):
        x = torch.randn(tokens, shape.hidden, generator=g, device=device).to(dtype)
        ids = torch.rand(tokens, shape.num_experts, generator=g, device=device).topk(shape.top_k, dim=-1).indices
        weights = torch.softmax(torch.randn(tokens, shape.top_k, generator=g, device=device), -1).to(dtype)
        out.append((x, weights, ids))
    return out


def fp8_experts(weights):
    """(e4m3 gate_up, e4m3 down, Fp8ExpertScales, the same weights dequantised to bf16 for the reference): one
    scale per output row, its largest value at e4m3's 448."""
    from dataclasses import replace

    from metronome.kernels.triton_moe import Fp8ExpertScales
    from metronome.server.models.quant import fp8

    def quantise(w):
        scale = fp8.dynamic_scale(w.abs().amax(dim=-1, keepdim=True)).contiguous()
        q = fp8.to_fp8(w, scale)
        return q, scale, fp8.dequantize(q, scale).to(w.dtype)

    gate_up, gate_up_scale, gate_up_ref = quantise(weights.gate_up)
    down, down_scale, down_ref = quantise(weights.down)
    return (gate_up, down, Fp8ExpertScales(gate_up_scale, down_scale),
            replace(weights, gate_up=gate_up_ref, down=down_ref))


def expert_bytes(shape: MoeShape, elem: int) -> int:
    per = 3 * shape.hidden * shape.inter + ((2 * shape.inter + shape.hidden) if shape.gpt_oss else 0)
    return per * elem


def run(args) -> dict:
    from metronome.kernels.triton_moe import MoeTiles, choose_tiles, fused_experts
    from metronome.server.models.moe_experts import experts_grouped_mm, experts_reference, grouped_mm_available

    device = torch.device("cpu" if args.smoke else "cuda")
    timer = _Timer(device)
    dtype = torch.bfloat16
    if device.type == "cuda":
        from hack.bench_kernels import copy_bandwidth
        bw, name = copy_bandwidth(device), torch.cuda.get_device_name()
    else:
        bw, name = float("nan"), "cpu (smoke)"
    print(f"{name}: copy bandwidth {bw:.0f} GB/s, torch {torch.__version__}, "
          f"grouped_mm {'yes' if grouped_mm_available() else 'no'}")
    rows = []
    wanted_models = set(args.models.split(",")) if args.models else None
    tokens_list = [int(t) for t in args.tokens.split(",")] if args.tokens else (SMOKE_TOKENS if args.smoke else TOKENS)
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        if wanted_models and shape.name not in wanted_models:
            continue
        spec = _spec(shape)
        weights = _weights(shape, device, dtype)
        gate_up, down, scales = weights.gate_up, weights.down, None
        if args.fp8:
            gate_up, down, scales, weights = fp8_experts(weights)
        for tokens in tokens_list:
            routings = _routings(shape, tokens, device, dtype)
            distinct = sum(int(ids.unique().numel()) for _, _, ids in routings) / ROUTINGS
            moved = distinct * expert_bytes(shape, 1 if args.fp8 else 2) + 2 * tokens * shape.hidden * 2
            flops = 2 * tokens * shape.top_k * 3 * shape.hidden * shape.inter

            def triton_call(tiles=None, weights=weights, spec=spec, routings=routings, gate_up=gate_up, down=down,
                            scales=scales):
                return [fused_experts(x, gate_up, down, w, ids, spec.activation, spec.swiglu_alpha,
                                      spec.swiglu_limit, weights.gate_up_bias, weights.down_bias, tiles=tiles,
                                      fp8_scales=scales)
                        for x, w, ids in routings]

            def over_routings(path_fn, weights=weights, spec=spec, routings=routings):
                return lambda: [path_fn(x, weights, w, ids, spec) for x, w, ids in routings]

            paths = {"naive": over_routings(experts_reference), "triton": triton_call}
            if grouped_mm_available() and not args.fp8:
                paths["grouped_mm"] = over_routings(experts_grouped_mm)
            expected = paths["naive"]()
            scale = max(e.abs().max().item() for e in expected)
            base_us = None
            for path, fn in paths.items():
                try:
                    got = fn()
                    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, expected)) / scale
                    graphed = path != "naive"
                    ms = (timer.graphed(fn) if graphed else timer.eager(fn)) / ROUTINGS
                    eager_ms = timer.eager(fn) / ROUTINGS if graphed else ms
                except Exception as exc:  # noqa: BLE001 - a path this torch lacks is reported, not fatal
                    print(f"{shape.name:14s} T={tokens:5d} {path:10s} failed: {type(exc).__name__}: {str(exc)[:160]}")
                    rows.append(dict(model=shape.name, tokens=tokens, path=path, error=f"{type(exc).__name__}: {exc}"))
                    continue
                us = ms * 1e3
                base_us = us if path == "naive" else base_us
                row = dict(model=shape.name, tokens=tokens, path=path, weights="fp8" if args.fp8 else "bf16",
                           us=us, eager_us=eager_ms * 1e3,
                           distinct_experts=distinct, bytes=moved, gb_per_s=moved / ms / 1e6,
                           bw_fraction=moved / ms / 1e6 / bw, tflop_per_s=flops / ms / 1e9, max_rel_err=err,
                           speedup_vs_naive=(base_us / us) if base_us else None,
                           tiles=asdict(choose_tiles(tokens, shape.top_k, shape.num_experts, timer.cuda))
                           if path == "triton" else None)
                rows.append(row)
                print(f"{shape.name:14s} T={tokens:5d} {path:10s} {us:9.1f} us (eager {eager_ms * 1e3:9.1f}) "
                      f"{row['gb_per_s']:6.0f} GB/s ({row['bw_fraction']:4.0%}) {row['tflop_per_s']:6.1f} TFLOP/s "
                      f"x{(base_us / us) if base_us else 0:5.1f} vs naive, err {err:.1e}")
            if args.sweep:
                rows += _sweep(shape, tokens, triton_call, moved, flops, MoeTiles, timer.graphed,
                               "fp8" if args.fp8 else "bf16")
    return dict(device=name, torch=torch.__version__, copy_gb_per_s=bw, routings=ROUTINGS, rows=rows)


# (block_n, block_k, warps, stages, down_block_n) per row block size; a few tokens: one pair a block or 16
LARGE_GRID = {block_m: ((64, 64, 4, 3, 64), (64, 128, 4, 3, 64), (64, 64, 4, 3, 128), (128, 64, 4, 3, 128),
                        (64, 64, 8, 4, 128), (128, 64, 8, 4, 256)) for block_m in (16, 32, 64, 128)}
FEW_TOKENS = 8
FEW_GRID = {block_m: ((16, 256, 2, 4, 16), (32, 128, 2, 4, 32), (32, 128, 4, 4, 32), (32, 256, 4, 3, 32),
                      (64, 128, 4, 3, 64), (64, 128, 4, 5, 64), (64, 256, 4, 3, 64), (128, 128, 4, 3, 128))
            for block_m in (1, 16)}


def _sweep(shape, tokens, call, moved, flops, tiles_class, bench, weights_kind) -> list[dict]:
    rows, best = [], None
    grid = FEW_GRID if tokens <= FEW_TOKENS else LARGE_GRID
    for block_m, shapes in grid.items():
        for block_n, block_k, warps, stages, down_n in shapes:
            tiles = tiles_class(block_m, block_n, block_k, group_m=1 if block_m <= 16 else 8, num_warps=warps,
                                num_stages=stages, down_block_n=down_n)
            try:
                ms = bench(lambda tiles=tiles: call(tiles)) / ROUTINGS
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
                print(f"    {tiles}: {type(exc).__name__}")
                continue
            row = dict(model=shape.name, tokens=tokens, path="triton_sweep", weights=weights_kind, us=ms * 1e3,
                       tiles=asdict(tiles),
                       gb_per_s=moved / ms / 1e6, tflop_per_s=flops / ms / 1e9)
            rows.append(row)
            if best is None or row["us"] < best["us"]:
                best = row
    if best:
        print(f"{'':14s} T={tokens:5d} best tiles {best['tiles']}: {best['us']:9.1f} us")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, of: {', '.join(s.name for s in SHAPES)}")
    parser.add_argument("--tokens", help=f"comma-separated token counts (default {','.join(map(str, TOKENS))})")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of Triton tile configs per case")
    parser.add_argument("--fp8", action="store_true", help="experts in e4m3 with a scale per row (W8A16)")
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench_moe needs a CUDA device", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = run(args)
    result["seconds"] = time.perf_counter() - started
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), **result), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

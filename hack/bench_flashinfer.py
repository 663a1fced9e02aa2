"""FlashInfer's paged decode kernels against Metronome's Triton attention on the same cache, run on the GPU machine
from the repo root with flashinfer-python installed:

    python3 -m hack.bench_flashinfer [--rounds 3] [--json rows.json]

One Llama-3-8B layer (32 query heads, 8 kv heads, head_dim 128), pages of 16 tokens stored token-major
(`[blocks, 16, 8, 128]`, FlashInfer's NHD), bf16 queries, an e4m3 or a bf16 cache. For each decode batch it checks
that both give the same output (max |diff|) and times CUDA-graph replays of Triton's `paged_attention` (its own
tiles), FlashInfer's CUDA-core decode and its tensor-core decode, in interleaved rounds; rates are the unique K/V
bytes read (plus q and out) over the time, against the measured copy rate.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from hack.bench_kernels import build_batch, copy_bandwidth, kv_bytes

CASES = [(f"decode_b{b}_2k", b, 2047) for b in (1, 16, 64, 256)] + [("decode_b512_1k5", 512, 1499),
                                                                     ("decode_b1_16k", 1, 16383)]


def flashinfer_pages(meta, block_size: int):
    """The block tables as FlashInfer's CSR page lists: indptr, indices, the last page's fill."""
    pages = [-(-s // block_size) for s in meta.seq_lens_host]
    indptr = torch.tensor([0] + [sum(pages[:i + 1]) for i in range(len(pages))], dtype=torch.int32,
                          device=meta.block_tables.device)
    indices = torch.cat([meta.block_tables[b, :n] for b, n in enumerate(pages)]).to(torch.int32)
    last = torch.tensor([s - (n - 1) * block_size for s, n in zip(meta.seq_lens_host, pages)], dtype=torch.int32,
                        device=meta.block_tables.device)
    return indptr, indices, last


def flashinfer_decode(q, k_cache, v_cache, meta, scale, tensor_cores: bool, workspace):
    import flashinfer
    n_heads, head_dim = q.shape[1], q.shape[2]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    indptr, indices, last = flashinfer_pages(meta, k_cache.shape[1])
    wrapper.plan(indptr, indices, last, n_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
                 q_data_type=q.dtype, kv_data_type=k_cache.dtype, o_data_type=q.dtype, sm_scale=scale)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, (k_cache, v_cache), out=out)


def triton_decode(paged_attention, q, k_cache, v_cache, meta, scale, scales):
    return lambda: paged_attention(q, k_cache, v_cache, meta, scale, **scales)


def run(args) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    from metronome.kernels.triton_attention import paged_attention

    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    n_kv, group, head_dim, block_size = 8, 4, 128, 16
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s")
    rows = []
    for kv_name in args.kv:
        for name, batch, ctx in CASES:
            if args.cases and not any(part in name for part in args.cases.split(",")):
                continue
            q, k_cache, v_cache, meta = build_batch([1] * batch, [ctx] * batch, block_size, n_kv, group, head_dim,
                                                    torch.bfloat16, device)
            scales = {}
            if kv_name == "fp8":
                k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
                ones = torch.ones(n_kv, dtype=torch.float32, device=device)
                scales = dict(k_scale=ones, v_scale=ones)
            scale = 1.0 / math.sqrt(head_dim)
            variants = {"triton": triton_decode(paged_attention, q, k_cache, v_cache, meta, scale, scales)}
            for label, tc in (("flashinfer_cuda_cores", False), ("flashinfer_tensor_cores", True)):
                try:
                    variants[label] = flashinfer_decode(q, k_cache, v_cache, meta, scale, tc, workspace)
                except Exception as exc:  # noqa: BLE001 - a kernel FlashInfer lacks is reported, not fatal
                    print(f"  {kv_name} {name} {label}: {type(exc).__name__}: {str(exc)[:200]}")
            reference = variants["triton"]().float()
            diffs = {label: (fn().float() - reference).abs().max().item() for label, fn in variants.items()}
            times: dict[str, list[float]] = {label: [] for label in variants}
            for _ in range(args.rounds):
                for label, fn in variants.items():
                    times[label].append(do_bench_cudagraph(fn))
            moved = kv_bytes(meta, n_kv, head_dim, 1 if kv_name == "fp8" else 2) + 2 * q.numel() * 2
            for label, samples in times.items():
                ms = statistics.median(samples)
                row = dict(kv=kv_name, case=name, kernel=label, us=ms * 1e3, samples_us=[t * 1e3 for t in samples],
                           gb_per_s=moved / ms / 1e6, copy_share=moved / ms / 1e6 / bw,
                           max_abs_diff_vs_triton=diffs[label])
                rows.append(row)
                print(f"{kv_name:4s} {name:16s} {label:24s} {row['us']:8.1f} us  {row['gb_per_s']:6.0f} GB/s "
                      f"({row['copy_share']:.0%})  max|diff| {row['max_abs_diff_vs_triton']:.2e}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(device=torch.cuda.get_device_name(), copy_gb_per_s=bw, args=vars(args),
                                   rows=rows), f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv", type=lambda t: t.split(","), default=["fp8", "bf16"], help="fp8,bf16")
    parser.add_argument("--cases", help="comma-separated substrings of the case names to run")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_flashinfer needs a CUDA device", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FlashAttention-4 against the Triton kernel per batch class (kernels/attention_choice.py), on one layer of a
Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16, block size 16), and the table `--attention-backend
auto` reads, written in its own format.

    python3 -m hack.bench_attention --out attention_table.json        # on the GPU machine, from the repo root

Each class's representative batch (decodes at their context, a chunk at its start) runs through both backends on
the same paged cache and metadata: device time per call (CUDA events over back-to-back calls) and host time per
call (the launch alone, no synchronisation). Between the piecewise graphs' pieces the host launches each
attention, so a call costs the larger of the two: that decides the class. FA4's output is checked against
Triton's (relative RMS difference) before it is timed; a class where FA4 fails or is absent stays on Triton.
The file written replaces kernels/attention_table.json once the numbers are read and accepted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time


def make_batch(torch, decodes: int, chunk: int, context: int, device, heads=32, kv_heads=8, head_dim=128,
               block=16, seed=0):
    """A paged cache holding every sequence's context in shuffled blocks, and the batch's q and metadata."""
    from metronome.kernels.metadata import AttentionMetadata

    g = torch.Generator(device="cpu").manual_seed(seed)
    q_lens = [1] * decodes + ([chunk] if chunk else [])
    seq_lens = [context + 1] * decodes + ([context + chunk] if chunk else [])
    pages = [math.ceil(n / block) for n in seq_lens]
    num_blocks = sum(pages) + 1
    order = torch.randperm(num_blocks - 1, generator=g)
    width = max(pages)
    table = torch.zeros(len(q_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n].to(torch.int32)
        used += n
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    ints = torch.tensor(cu + seq_lens, dtype=torch.int32, device=device)
    meta = AttentionMetadata(cu_seqlens_q=ints[:len(cu)], seq_lens=ints[len(cu):], block_tables=table.to(device),
                             slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64, device=device),
                             max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), q_lens_host=q_lens,
                             seq_lens_host=seq_lens)
    q = torch.randn(cu[-1], heads, head_dim, dtype=torch.bfloat16, device=device)
    return q, k_cache, v_cache, meta


def time_backend(torch, backend, q, k_cache, v_cache, meta, iters: int) -> dict:
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    for _ in range(3):
        backend.attention(q, k_cache, v_cache, meta, scale, out=out)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        backend.attention(q, k_cache, v_cache, meta, scale, out=out)
        host += time.perf_counter() - t0
    stop.record()
    torch.cuda.synchronize()
    device_ms = start.elapsed_time(stop) / iters
    host_ms = host * 1e3 / iters
    return {"device_ms": device_ms, "host_ms": host_ms, "per_call_ms": max(device_ms, host_ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    from metronome.kernels.attention_choice import BATCH_CLASSES, choose, parse_table
    from metronome.kernels.flash_attn_backend import FlashAttnBackend, fa4_importable
    from metronome.kernels.triton_backend import TritonBackend

    device = torch.device("cuda")
    triton = TritonBackend()
    flash, flash_error = None, None
    try:
        flash = FlashAttnBackend() if fa4_importable() else None
        flash_error = None if flash is not None else "flash_attn.cute does not import"
    except Exception as exc:  # noqa: BLE001 - reported; every class then stays on Triton
        flash_error = f"{type(exc).__name__}: {exc}"
    results: dict = {}
    times: dict = {}
    for batch_class in BATCH_CLASSES:
        decodes, chunk, context = batch_class.representative
        q, k_cache, v_cache, meta = make_batch(torch, decodes, chunk, context, device)
        row: dict = {"decodes": decodes, "chunk": chunk, "context": context}
        row["triton"] = time_backend(torch, triton, q, k_cache, v_cache, meta, args.iters)
        if flash is not None:
            try:
                t0 = time.perf_counter()
                got = flash.attention(q, k_cache, v_cache, meta, q.shape[-1] ** -0.5).float()
                torch.cuda.synchronize()
                row["flash_attn_first_call_s"] = time.perf_counter() - t0  # its compile, where new
                expected = triton.attention(q, k_cache, v_cache, meta, q.shape[-1] ** -0.5).float()
                error = ((got - expected).norm() / expected.norm()).item()
                row["flash_attn_rel_diff_vs_triton"] = error
                if not math.isfinite(error) or error > 2e-2:
                    raise RuntimeError(f"FA4 disagrees with Triton (relative RMS difference {error:.3g})")
                row["flash_attn"] = time_backend(torch, flash, q, k_cache, v_cache, meta, args.iters)
            except Exception as exc:  # noqa: BLE001 - this class stays on Triton
                row["flash_attn_error"] = f"{type(exc).__name__}: {exc}"
        elif flash_error:
            row["flash_attn_error"] = flash_error
        times[batch_class.name] = {"triton": row["triton"]["per_call_ms"],
                                   "flash_attn": (row.get("flash_attn") or {}).get("per_call_ms")}
        results[batch_class.name] = row
        fa = row.get("flash_attn")
        tri = row["triton"]
        fa4 = (f"fa4 {fa['device_ms']:7.3f} ms (host {fa['host_ms']:.3f}, diff "
               f"{row['flash_attn_rel_diff_vs_triton']:.1e})" if fa else f"fa4 - ({row.get('flash_attn_error')})")
        print(f"{batch_class.name:<14} triton {tri['device_ms']:7.3f} ms (host {tri['host_ms']:.3f})   {fa4}",
              flush=True)
        del q, k_cache, v_cache, meta
        torch.cuda.empty_cache()
    choice = choose(times)
    try:
        import flash_attn.cute as cute_module
        fa4_version = getattr(cute_module, "__version__", None)
    except Exception:  # noqa: BLE001
        fa4_version = None
    measured = {"date": datetime.date.today().isoformat(), "machine": torch.cuda.get_device_name(),
                "command": "python3 -m hack.bench_attention " + " ".join(sys.argv[1:]),
                "torch": torch.__version__, "flash_attn_4": fa4_version, "python": platform.python_version(),
                "shape": "Llama-3-8B layer: 32 heads, 8 KV heads, head_dim 128, bf16, block size 16",
                "per_call": "max(device time, host launch time) per call"}
    table = parse_table({"measured": measured, "choice": choice, "results": results,
                         "note": "Measured by hack/bench_attention.py; per class the backend with the lower time per "
                                 "call, Triton where FA4 failed, was absent or tied."})
    with open(args.out, "w") as f:
        json.dump(table.to_json(), f, indent=1)
    print("choice: " + ", ".join(f"{k}={v}" for k, v in choice.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

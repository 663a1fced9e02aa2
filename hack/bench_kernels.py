"""Microbenchmark of the Triton attention and KV-write kernels on CUDA, run on the GPU machine from the repo root:

    python3 -m hack.bench_kernels [--sweep] [--json rows.json]

Times decode-only and mixed batches of a Llama-3-8B layer (32 query heads, 8 kv heads, head_dim 128, bf16) with
triton.testing.do_bench and prints achieved bandwidth (unique K/V bytes read + q/out, over the time) next to the
GPU's measured copy bandwidth, and TFLOP/s for batches with prefill chunks. `--sweep` also tries a grid of tile
configs and split counts per case, to tune `choose_config` / `choose_num_splits` in one GPU call. `--kv-fp8` stores
the cache in e4m3 (per-head scales of 1) and counts its bytes as one per element. `--json PATH`
writes every row. It reads the kernels' private tiling helpers on purpose: it is their tuning tool.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace

import torch

from metronome.kernels.metadata import AttentionMetadata

# (name, q_lens, ctx_lens): ctx = cached tokens before the step
DECODE_CASES = [(f"decode_b{b}_2k", [1] * b, [2047] * b) for b in (1, 16, 64, 256)] + [
    # the saturation run's full decode batch at its mean context
    ("sat_decode_b921_1328", [1] * 921, [1327] * 921),
]
MIXED_CASES = [
    ("decode_b1_16k", [1], [16383]),
    ("mixed_chunk512_plus63dec_2k", [512] + [1] * 63, [1536] + [2047] * 63),
    ("mixed_chunk256_plus16dec_2k", [256] + [1] * 16, [1024] + [2047] * 16),
    ("prefill_chunk512_ctx1536", [512], [1536]),
    ("prefill_2048_fresh", [2048], [0]),
    ("prefill_4x1024_fresh", [1024] * 4, [0] * 4),
    # the engine's order: running decodes lead, the prompt chunk comes last
    ("lead64dec_2k_chunk512", [1] * 64 + [512], [2047] * 64 + [0]),
    ("lead64dec_2k_chunk2048", [1] * 64 + [2048], [2047] * 64 + [0]),
    ("lead64dec_2k_chunk512_ctx1536", [1] * 64 + [512], [2047] * 64 + [1536]),
    ("lead256dec_2k_chunk512", [1] * 256 + [512], [2047] * 256 + [0]),
    # the saturation run's prefill phase: an 8,192-token chunk of fresh 1,000-token prompts beside the decodes of
    # the prompts before them
    *[(f"sat_lead{d}dec_1k_chunk8192", [1] * d + [1000] * 8 + [192], [1000] * d + [0] * 9) for d in (110, 470, 850)],
]


def build_batch(q_lens, ctx_lens, block_size, n_kv_heads, group, head_dim, dtype, device):
    """Random cache and shuffled block tables straight on the device (no reference data: timing only)."""
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    tables = torch.zeros(len(q_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[start:start + n]
        start += n
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, n_kv_heads * group, head_dim, dtype=dtype, device=device)
    cu = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(q_lens))], dtype=torch.int32, device=device)
    pos = torch.cat([torch.arange(c, s, device=device) for c, s in zip(ctx_lens, seq_lens)])
    owner = torch.cat([torch.full((n,), b, device=device) for b, n in enumerate(q_lens)])
    slots = tables[owner, pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(cu, torch.tensor(seq_lens, dtype=torch.int32, device=device), tables, slots,
                             max(q_lens), max(seq_lens), list(q_lens), seq_lens)
    return q, k_cache, v_cache, meta


def kv_bytes(meta: AttentionMetadata, n_kv_heads: int, head_dim: int, elem: int) -> int:
    return sum(meta.seq_lens_host) * n_kv_heads * head_dim * 2 * elem


def attention_flops(meta: AttentionMetadata, n_heads: int, head_dim: int) -> int:
    """QK^T and PV over the visible (causal) keys only."""
    visible = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(meta.q_lens_host, meta.seq_lens_host))
    return 4 * visible * n_heads * head_dim


def chosen_config(meta: AttentionMetadata, n_kv_heads: int, group_pad: int, head_dim: int, kv_fp8: bool):
    """The tile config paged_attention picks by itself for this batch (for the printout)."""
    from metronome.kernels.triton_attention import _batch_shape, _sm_count, batch_fill, choose_config
    lead, any_decode = _batch_shape(meta)
    busy, queued = batch_fill(meta.num_seqs, n_kv_heads, _sm_count(torch.cuda.current_device()))
    return choose_config(lead == meta.num_seqs, not any_decode, busy, group_pad,
                         max(16, 1 << (head_dim - 1).bit_length()), True, kv_fp8,
                         chunk_tokens=meta.num_tokens - lead, queued=queued)


def time_call(fn, full: bool = True) -> dict:
    """gpu_ms: CUDA-graph replay (no host cost; small working sets stay in L2). With `full`, also eager_ms
    (do_bench: launches from Python, L2 flushed) and host_ms (Python + launch cost per call, back to back)."""
    from triton.testing import do_bench, do_bench_cudagraph
    timing = dict(gpu_ms=do_bench_cudagraph(fn))
    if full:
        timing["eager_ms"] = do_bench(fn)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            fn()
        timing["host_ms"] = (time.perf_counter() - start) * 1e3 / 100
        torch.cuda.synchronize()
    return timing


def copy_bandwidth(device) -> float:
    """Measured device copy bandwidth in GB/s (read + write of 1 GiB)."""
    from triton.testing import do_bench
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6


def sweep_grid(decode: bool, group_pad: int, kv_fp8: bool = False):
    """Tile configs worth trying; each is one compile, so the grid stays small."""
    from metronome.kernels.triton_attention import V_AS_LOADED, V_ASM, V_CONVERTED_FIRST, TileConfig
    if kv_fp8:  # each way of bringing the 8-bit V tile to its dot, over the tiles that stream FP8 best
        reads = (V_AS_LOADED, V_ASM, V_CONVERTED_FIRST)
        if decode:
            return [TileConfig(64, 64, w, st, decode_block_n=n, v_read=r) for r in reads for n in (64, 128, 256)
                    for w, st in ((2, 3), (4, 2), (4, 3), (4, 4))]
        return [TileConfig(max(m, group_pad), 64, w, st, decode_block_n=128, v_read=r) for r in reads
                for m, w, st in ((64, 4, 3), (128, 8, 2), (128, 4, 2))]
    if decode:
        shapes = [(4, 2), (4, 3), (4, 4), (2, 3), (8, 3)]
        return [TileConfig(64, 64, w, st, decode_block_n=n) for n in (32, 64, 128) for w, st in shapes]
    shapes = [(4, 2), (4, 3), (8, 2)]
    return [TileConfig(max(m, group_pad), 64, w, st, decode_block_n=dn)
            for m in (64, 128) for w, st in shapes for dn in (64, 128)]


def run(args) -> list[dict]:
    from metronome.kernels.triton_attention import TileConfig, paged_attention
    from metronome.kernels.triton_kv_write import write_kv_triton

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    elem = torch.finfo(dtype).bits // 8
    kv_elem = 1 if args.kv_fp8 else elem
    n_kv, group, head_dim = args.kv_heads, args.group, args.head_dim
    n_heads = n_kv * group
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s; layer {n_heads}q/{n_kv}kv x {head_dim}, "
          f"{args.dtype}, block_size {args.block_size}")
    rows = []
    for name, q_lens, ctx_lens in DECODE_CASES + MIXED_CASES:
        if args.cases and not any(part in name for part in args.cases.split(",")):
            continue
        q, k_cache, v_cache, meta = build_batch(q_lens, ctx_lens, args.block_size, n_kv, group, head_dim, dtype,
                                                device)
        scale = 1.0 / math.sqrt(head_dim)
        kv_scales: dict = {}
        if args.kv_fp8:
            k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
            ones = torch.ones(n_kv, dtype=torch.float32, device=device)
            kv_scales = {"k_scale": ones, "v_scale": ones}
        moved = kv_bytes(meta, n_kv, head_dim, kv_elem) + 2 * q.numel() * elem
        flops = attention_flops(meta, n_heads, head_dim)
        group_pad = 1 << (group - 1).bit_length()
        # (tiles, key splits, two launches): None is paged_attention's own choice
        configs: list[tuple[TileConfig | None, int | None, bool | None]] = [(None, None, None)]
        if args.sweep:
            configs += [(c, None, None) for c in sweep_grid(meta.max_seqlen_q == 1, group_pad, args.kv_fp8)]
            if meta.num_tokens <= 256:
                configs += [(None, s, None) for s in (1, 2, 4, 8, 16)]
        if args.v_read_ab:  # the tiles paged_attention picks, once per V read mode, in interleaved rounds
            chosen = chosen_config(meta, n_kv, group_pad, head_dim, args.kv_fp8)
            configs += [(replace(chosen, v_read=mode), None, None) for _ in range(args.v_read_ab)
                        for mode in args.v_read_modes]
        if args.registers_ab:  # the tiles paged_attention picks (or --tiles), under each register cap (0: none)
            chosen = chosen_config(meta, n_kv, group_pad, head_dim, args.kv_fp8)
            tiles = [replace(chosen, decode_block_n=n, num_warps=w, num_stages=st) for n, w, st in args.tiles] or [
                replace(chosen, num_stages=stages or chosen.num_stages) for stages in args.stages]
            configs += [(replace(tile, max_registers=cap), splits, None)
                        for _ in range(args.registers_ab) for tile in tiles for cap in args.register_caps
                        for splits in args.register_splits]
        if args.apart_ab and meta.max_seqlen_q > 1 and meta.q_lens_host[0] == 1:  # leading decodes and a chunk
            configs += [(None, None, apart) for _ in range(args.apart_ab) for apart in (False, True)]
        best = None
        for cfg, splits, apart in configs:
            def call(cfg=cfg, splits=splits, apart=apart, q=q, k_cache=k_cache, v_cache=v_cache, meta=meta,
                     scale=scale, kv_scales=kv_scales):
                return paged_attention(q, k_cache, v_cache, meta, scale, config=cfg, num_splits=splits, apart=apart,
                                       **kv_scales)
            try:
                timing = time_call(call, full=cfg is None and splits is None and apart is None)
            except Exception as exc:  # noqa: BLE001 - a config that does not fit (shared memory) is skipped
                print(f"  {name}: {cfg} splits={splits}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            ms = timing["gpu_ms"]
            row = dict(case=name, config=asdict(cfg) if cfg else "default", num_splits=splits or "auto",
                       apart="auto" if apart is None else apart, **timing,
                       gb_per_s=moved / ms / 1e6, tflop_per_s=flops / ms / 1e9, bw_fraction=moved / ms / 1e6 / bw)
            rows.append(row)
            if best is None or ms < best["gpu_ms"]:
                best = row
            if apart is not None:
                print(f"{name:30s} {'two launches' if apart else 'one launch':12s}: gpu {ms * 1e3:8.1f} us  "
                      f"{row['gb_per_s']:6.0f} GB/s {row['tflop_per_s']:6.1f} TFLOP/s")
            if cfg is not None and args.registers_ab:
                print(f"{name:30s} {cfg.decode_block_n} keys, {cfg.num_warps} warps, {cfg.num_stages} stages, "
                      f"registers {cfg.max_registers or 'auto':>4}, splits {splits or 'auto'}: gpu "
                      f"{ms * 1e3:8.1f} us  {row['gb_per_s']:6.0f} GB/s ({row['bw_fraction']:.0%} of copy)")
            if cfg is None and splits is None and apart is None:
                used = chosen_config(meta, n_kv, group_pad, head_dim, args.kv_fp8)
                print(f"{name:30s} {used}: gpu {ms * 1e3:7.1f} us  {row['gb_per_s']:6.0f} GB/s "
                      f"({row['bw_fraction']:.0%} of copy) {row['tflop_per_s']:6.1f} TFLOP/s | eager "
                      f"{timing['eager_ms'] * 1e3:7.1f} us, host {timing['host_ms'] * 1e3:6.1f} us/call")
        if args.sweep and best is not None:
            print(f"{'':30s} best {best['config']} splits={best['num_splits']}: {best['gpu_ms'] * 1e3:7.1f} us  "
                  f"{best['gb_per_s']:7.0f} GB/s  {best['tflop_per_s']:6.1f} TFLOP/s")
        if meta.max_seqlen_q == 1 and args.sdpa_peer:
            rows.append(_sdpa_peer(name, q, meta, n_kv, head_dim, dtype, moved, scale))
        write_rows(args, rows)  # after every case: a sweep cut short by its time limit keeps what it measured
    for num_tokens in (64, 512, 4096):
        q, k_cache, v_cache, meta = build_batch([num_tokens], [0], args.block_size, n_kv, group, head_dim, dtype,
                                                device)
        key = torch.randn(num_tokens, n_kv, head_dim, dtype=dtype, device=device)
        value = torch.randn_like(key)
        timing = time_call(lambda key=key, value=value, k_cache=k_cache, v_cache=v_cache, meta=meta:
                           write_kv_triton(key, value, k_cache, v_cache, meta.slot_mapping))
        moved = 4 * key.numel() * elem
        ms = timing["gpu_ms"]
        rows.append(dict(case=f"write_kv_{num_tokens}", **timing, gb_per_s=moved / ms / 1e6))
        print(f"write_kv {num_tokens:5d} tokens: gpu {ms * 1e3:7.1f} us  {moved / ms / 1e6:6.0f} GB/s | eager "
              f"{timing['eager_ms'] * 1e3:7.1f} us, host {timing['host_ms'] * 1e3:6.1f} us/call")
    return rows


def _sdpa_peer(name, q, meta, n_kv, head_dim, dtype, moved, scale) -> dict:
    """torch SDPA decode over a dense, contiguous cache of the same size: what a non-paged kernel reaches."""
    import torch.nn.functional as F
    batch, max_len = meta.num_seqs, meta.max_seqlen_k
    k = torch.randn(batch, n_kv, max_len, head_dim, dtype=dtype, device=q.device)
    v = torch.randn_like(k)
    qd = q.view(batch, -1, 1, head_dim)
    timing = time_call(lambda: F.scaled_dot_product_attention(qd, k, v, scale=scale, enable_gqa=True))
    ms = timing["gpu_ms"]
    print(f"{'':30s} peer torch SDPA (dense cache): gpu {ms * 1e3:7.1f} us  {moved / ms / 1e6:6.0f} GB/s | eager "
          f"{timing['eager_ms'] * 1e3:7.1f} us")
    return dict(case=name, config="torch_sdpa_dense", **timing, gb_per_s=moved / ms / 1e6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per kv head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--sweep", action="store_true", help="also try a grid of tile configs and split counts")
    parser.add_argument("--kv-fp8", action="store_true", help="an e4m3 KV cache (per-head scales of 1)")
    parser.add_argument("--v-read-ab", type=int, default=0, metavar="ROUNDS",
                        help="with --kv-fp8: the chosen tiles with each V read mode, ROUNDS interleaved rounds")
    parser.add_argument("--v-read-modes", type=lambda text: [int(m) for m in text.split(",")],
                        default=[0, 2, 3], metavar="M,M",
                        help="the V read modes --v-read-ab compares (triton_attention's V_AS_LOADED = 0, V_ASM = 2, "
                             "V_CONVERTED_FIRST = 3)")
    parser.add_argument("--apart-ab", type=int, default=0, metavar="ROUNDS",
                        help="batches of leading decodes and a chunk as one launch and as two (decodes, chunks), "
                             "ROUNDS interleaved rounds")
    parser.add_argument("--registers-ab", type=int, default=0, metavar="ROUNDS",
                        help="the chosen tiles under each --register-caps cap and --stages count, ROUNDS interleaved "
                             "rounds: fewer registers a thread, more programs an SM")
    parser.add_argument("--register-caps", type=lambda text: [int(c) for c in text.split(",")], default=[0, 168, 128],
                        metavar="N,N", help="registers per thread for --registers-ab (0: the compiler's choice)")
    parser.add_argument("--stages", type=lambda text: [int(c) for c in text.split(",")], default=[0], metavar="N,N",
                        help="pipeline stages for --registers-ab (0: the chosen tiles' own)")
    parser.add_argument("--tiles", type=lambda text: [tuple(int(v) for v in t.split(":")) for t in text.split(",")],
                        default=[], metavar="KEYS:WARPS:STAGES,...",
                        help="decode tiles for --registers-ab instead of the chosen one (and --stages)")
    parser.add_argument("--register-splits", type=lambda text: [int(c) or None for c in text.split(",")],
                        default=[None], metavar="N,N",
                        help="key splits for --registers-ab (0: paged_attention's own count)")
    parser.add_argument("--sdpa-peer", action="store_true", help="time torch SDPA on a dense cache for decodes")
    parser.add_argument("--cases", help="comma-separated substrings: run only the cases whose names contain one")
    parser.add_argument("--json", help="write all rows to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device", file=sys.stderr)
        return 2
    write_rows(args, run(args))
    return 0


def write_rows(args, rows: list[dict]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

"""Attention kernels: the torch reference against naive dense attention, Triton (interpreter) against the reference.

Triton runs CPU tensors only in its interpreter, which must be switched on before triton is first imported; other
test modules may import it earlier in this process, so the Triton side runs once, in a subprocess started with
TRITON_INTERPRET=1 (this file run as a script), and hands its outputs back for the comparisons here.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

from metronome.kernels import AttentionMetadata, available_backends, get_backend, select_backend
from metronome_testing.random_batch import PagedBatch, make_paged_batch


@dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    block_size: int
    n_kv_heads: int
    group: int
    head_dim: int
    dtype: str = "float32"
    tile: tuple[int, int] | None = None  # (block_m, block_n) instead of the default tiles
    num_splits: int | None = None
    window: int | None = None  # sliding window: a query at p sees keys p - window + 1 .. p
    softcap: float | None = None
    sinks: bool = False  # a learned logit per head in every softmax denominator (gpt-oss)
    apart: bool | None = None  # leading decodes and chunks as two launches (None: the kernel's own choice)


# Each axis of the grid is covered at least once: q_len 1..300, contexts up to 2,000, block sizes
# 16/64/256, GQA 1/4/8 (and 3, SmolLM2's), head dims 64/128 (and 96, padded), split-K, tiles spanning pages;
# some contexts end one short of / at a key-tile edge (62, 63, 126), where off-by-one masks show. Leading decodes
# (own small tiles) and decodes after a chunk (inside chunk tiles) both occur.
CASES = [
    Case("decode_b16_g1_d64", (1,) * 6, (0, 15, 62, 63, 700, 1999), 16, 2, 1, 64),
    Case("mixed_b64_g4_d128", (1, 1, 300, 1, 37, 5), (2000, 64, 0, 63, 129, 1), 64, 1, 4, 128),
    Case("mixed_b256_g8_d64", (300, 1, 17, 1), (1700, 255, 256, 0), 256, 1, 8, 64),
    Case("chunks_b16_g3_d96", (16, 1, 33, 5), (16, 40, 100, 126), 16, 1, 3, 96),
    Case("small_tiles_span_pages", (1, 45, 1), (400, 20, 77), 16, 2, 4, 64, tile=(16, 64)),
    Case("chunk_tiles_with_leading_decodes", (1, 1, 150, 1), (300, 40, 100, 7), 16, 1, 4, 64, tile=(128, 64)),
    Case("split_k_decode", (1, 1, 1), (1500, 3, 600), 64, 1, 8, 128, num_splits=4),
    Case("split_k_mixed", (1, 20, 1), (500, 300, 90), 16, 1, 4, 64, num_splits=2),
    Case("bf16_mixed", (1, 70, 1), (900, 30, 0), 64, 2, 4, 64, dtype="bfloat16"),
    Case("fp16_decode", (1, 1), (120, 33), 16, 1, 8, 128, dtype="float16"),
    # Sliding windows: decodes and chunks longer and shorter than the window, chunks that do not divide it, a
    # window smaller than a key tile and one spanning several, with split-K; blocks wholly behind every query's
    # window are NaN-poisoned (freed and reused), so reading one shows.
    Case("window_mixed_b16", (1, 1, 45, 1, 7), (700, 3, 90, 40, 33), 16, 2, 4, 64, window=40),
    Case("window_small_b4_g3", (1, 13, 1, 30), (250, 20, 9, 100), 4, 1, 3, 32, window=7),
    Case("window_split_k", (1, 1, 1), (1500, 300, 20), 64, 1, 8, 128, num_splits=4, window=300),
    Case("window_bf16_d256", (1, 70, 1), (900, 30, 0), 16, 1, 4, 256, dtype="bfloat16", window=64),
    Case("softcap_mixed", (1, 33, 1), (200, 10, 40), 16, 2, 2, 64, softcap=5.0),
    # Attention sinks (gpt-oss: head_dim 64, 8 query heads per kv head, window layers): alone, with a window and
    # split-K (the sink joins in the merge), and in bf16.
    Case("sinks_mixed_g8", (1, 1, 45, 1, 7), (700, 3, 90, 40, 0), 16, 1, 8, 64, sinks=True),
    Case("sinks_window_split_k", (1, 1, 1), (1500, 300, 20), 64, 1, 8, 64, num_splits=4, window=128, sinks=True),
    Case("sinks_bf16_window", (1, 70, 1), (900, 30, 0), 16, 1, 8, 64, dtype="bfloat16", window=40, sinks=True),
    # A mixed batch as two launches: leading decodes on decode tiles, then the chunks (a decode among them rides in
    # a chunk tile); with a window and sinks in bf16; and a batch with no leading decode, which stays one launch.
    Case("apart_decodes_then_chunks", (1, 1, 1, 1, 1, 60, 1, 23), (300, 17, 0, 64, 1000, 40, 90, 0), 16, 2, 4, 64,
         apart=True),
    Case("apart_window_sinks_bf16", (1, 1, 1, 45, 7), (700, 3, 200, 90, 33), 16, 1, 8, 64, dtype="bfloat16",
         window=40, sinks=True, apart=True),
    Case("apart_without_leading_decodes", (30, 1, 1), (10, 50, 60), 16, 1, 4, 64, apart=True),
]
CASES_BY_NAME = {c.name: c for c in CASES}
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-3}  # vs the fp32-accumulating reference, inputs of that dtype


def build(case: Case) -> PagedBatch:
    return make_paged_batch(list(case.q_lens), list(case.ctx_lens), case.block_size, case.n_kv_heads, case.group,
                            case.head_dim, dtype=getattr(torch, case.dtype), seed=zlib.crc32(case.name.encode()))


def scale_of(case: Case) -> float:
    return 1.0 / math.sqrt(case.head_dim)


def sinks_of(case: Case) -> torch.Tensor | None:
    """Sink logits of a case with sinks: some far below the scores (little effect), some far above (most of the
    softmax mass), in the case's dtype."""
    if not case.sinks:
        return None
    n_heads = case.n_kv_heads * case.group
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + 1)
    return (torch.randn(n_heads, generator=generator) * 3.0).to(getattr(torch, case.dtype))


def poison_behind_window(batch: PagedBatch, window: int) -> None:
    """NaN into every cache block wholly behind the window of a sequence's first new token (a freed block that
    another sequence may have reused)."""
    meta, block_size = batch.meta, batch.k_cache.shape[1]
    for b, (q_len, seq_len) in enumerate(zip(meta.q_lens_host, meta.seq_lens_host)):
        dead = max(0, seq_len - q_len - window + 1) // block_size
        for block in meta.block_tables[b, :dead].tolist():
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")


def run_backend(backend_name: str, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """write_kv of the new tokens, then attention: (output, k_cache, v_cache)."""
    batch = build(case)
    backend = get_backend(backend_name)
    backend.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    if case.window is not None:
        poison_behind_window(batch, case.window)
    if backend_name == "triton" and (case.tile or case.num_splits or case.apart is not None):
        from metronome.kernels.triton_attention import TileConfig, paged_attention
        tile = TileConfig(*case.tile) if case.tile else None
        out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale_of(case), config=tile,
                              num_splits=case.num_splits, window=case.window, softcap=case.softcap,
                              sinks=sinks_of(case), apart=case.apart)
    else:
        out = backend.attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale_of(case),
                                window=case.window, softcap=case.softcap, sinks=sinks_of(case))
    return out, batch.k_cache, batch.v_cache


def naive_attention(batch: PagedBatch, scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense float64 attention per sequence and head from the generator's own K/V, one query row at a time; a
    head's sink is one more softmax entry whose value is dropped."""
    meta = batch.meta
    n_heads = batch.q.shape[1]
    group = n_heads // batch.key.shape[1]
    out = torch.empty(batch.q.shape, dtype=torch.float64)
    row = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.q_lens_host, meta.seq_lens_host)):
        k, v = batch.dense_k[b].double(), batch.dense_v[b].double()
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            first = 0 if window is None else max(0, visible - window)
            for h in range(n_heads):
                scores = (k[first:visible, h // group] @ batch.q[row, h].double()) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h].double().view(1)])
                    out[row, h] = torch.softmax(scores, 0)[:-1] @ v[first:visible, h // group]
                    continue
                out[row, h] = torch.softmax(scores, 0) @ v[first:visible, h // group]
            row += 1
    return out


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    """Every case run through the Triton backend in one interpreter subprocess: name -> (out, k_cache, v_cache)."""
    out_path = tmp_path_factory.mktemp("triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, str(out_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"triton interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return torch.load(out_path)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_matches_torch_reference(case, triton_results):
    result = triton_results[case.name]
    assert not isinstance(result, str), f"triton raised: {result}"
    out, k_cache, v_cache = result
    ref_out, ref_k, ref_v = run_backend("torch", case)
    # write_kv: the same slots written, everything else (NaN poison) untouched
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(out).all(), "triton output has NaN/inf: it read poisoned cache slots"
    tol = TOL[case.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "float32"], ids=lambda c: c.name)
def test_torch_reference_matches_naive_dense(case):
    batch = build(case)
    ref_out, _, _ = run_backend("torch", case)
    assert torch.isfinite(ref_out).all()
    expected = naive_attention(batch, scale_of(case), case.window, case.softcap, sinks_of(case))
    torch.testing.assert_close(ref_out.double(), expected, rtol=1e-5, atol=1e-5)


def test_torch_reference_is_exact_for_low_precision_inputs():
    """bf16 inputs: the reference equals fp32 attention over the same (rounded) values, rounded once at the end."""
    case = CASES_BY_NAME["bf16_mixed"]
    out, _, _ = run_backend("torch", case)
    batch = build(case)
    expected = naive_attention(batch, scale_of(case)).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def write_with_a_skipped_slot(backend_name: str) -> PagedBatch:
    batch = make_paged_batch([3, 1], [5, 16], block_size=16, n_kv_heads=2, group=1, head_dim=64, seed=3)
    slots = batch.meta.slot_mapping.clone()
    slots[1] = -1  # the second new token of sequence 0 is not stored
    get_backend(backend_name).write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, slots)
    return batch


def test_triton_write_kv_skips_negative_slots_like_torch(triton_results):
    k_cache, v_cache = triton_results["write_kv_skip"]
    ref = write_with_a_skipped_slot("torch")
    torch.testing.assert_close(k_cache, ref.k_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref.v_cache, rtol=0, atol=0, equal_nan=True)


def test_write_kv_skips_negative_slots_and_matches_dense_layout():
    batch = write_with_a_skipped_slot("torch")
    slots = batch.meta.slot_mapping.clone()
    slots[1] = -1
    block_size = batch.k_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(batch.k_cache[slot // block_size, slot % block_size], batch.key[t])
            assert torch.equal(batch.v_cache[slot // block_size, slot % block_size], batch.value[t])
    skipped = batch.meta.slot_mapping[1].item()
    assert torch.isnan(batch.k_cache[skipped // block_size, skipped % block_size]).all()
    assert int(torch.isfinite(batch.k_cache).all(-1).all(-1).sum()) == 5 + 16 + 3  # context + written tokens


def test_torch_backend_ignores_garbage_in_block_table_padding():
    batch = make_paged_batch([1, 4], [30, 2], block_size=16, n_kv_heads=1, group=2, head_dim=64, seed=5)
    backend = get_backend("torch")
    backend.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    expected = backend.attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    batch.meta.block_tables[:, 2:] = -7  # padding may hold anything, even invalid ids
    got = backend.attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_get_backend_names():
    assert get_backend("torch").name == "torch"
    assert "torch" in available_backends() and "triton" in available_backends()
    with pytest.raises(ValueError, match="torch, triton, flash_attn"):
        get_backend("cutlass")


def test_select_backend_rules(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend("cpu", 16, 64) == "torch"
    assert select_backend("cuda", 16, 128) == "triton"  # FA4 does not run here (and the table may not use it)
    assert select_backend("cpu", 16, 64, "torch") == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("cpu", 16, 64, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("cpu", 16, 64, "triton") == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("cpu", 16, 64, "xformers")
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("cuda", 16, 128, "flash_attn")  # FA4 is not installed here


def test_bad_inputs_raise_value_error():
    batch = make_paged_batch([2, 1], [3, 4], block_size=16, n_kv_heads=2, group=2, head_dim=64, seed=1)
    backend = get_backend("torch")
    with pytest.raises(ValueError, match="n_kv_heads"):
        backend.attention(batch.q[:, :3], batch.k_cache, batch.v_cache, batch.meta, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        backend.attention(batch.q.double(), batch.k_cache, batch.v_cache, batch.meta, 0.1)
    with pytest.raises(ValueError, match="new tokens"):
        backend.attention(batch.q[:2], batch.k_cache, batch.v_cache, batch.meta, 0.1)
    bad_meta = AttentionMetadata(**{**vars(batch.meta), "seq_lens_host": [1, 5]})
    with pytest.raises(ValueError, match="q_len <= seq_len"):
        backend.attention(batch.q, batch.k_cache, batch.v_cache, bad_meta, 0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        backend.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping[:1])


def _run_triton_cases(out_path: str) -> None:
    """Subprocess entry (TRITON_INTERPRET=1): every case through the Triton backend; errors are reported per case."""
    import traceback
    results = {}
    for case in CASES:
        try:
            results[case.name] = run_backend("triton", case)
        except Exception:  # noqa: BLE001 - reported to the test of that case
            results[case.name] = traceback.format_exc()
    batch = write_with_a_skipped_slot("triton")
    results["write_kv_skip"] = (batch.k_cache, batch.v_cache)
    torch.save(results, out_path)


if __name__ == "__main__":
    _run_triton_cases(sys.argv[1])


def test_split_and_tile_choices_stay_within_the_compiled_variants():
    from metronome.kernels.triton_attention import choose_config, choose_num_splits
    for programs in (1, 8, 64, 131, 132, 1000):
        for max_k in (16, 1023, 1024, 2048, 100_000):
            splits = choose_num_splits(programs, num_tokens=programs, max_seqlen_k=max_k, sm_count=132)
            assert splits in (1, 2, 4, 8, 16)
            if programs >= 132 or max_k < 1024:
                assert splits == 1  # a full GPU or a short context gains nothing from splitting
            assert max_k // splits >= 256 or splits == 1
    assert choose_num_splits(8, num_tokens=300, max_seqlen_k=8192, sm_count=132) == 1  # big batches never split
    from metronome.kernels.triton_attention import FP8_APART_MIN_CHUNK_TOKENS, LONG_CHUNK_TOKENS, launch_apart
    # two launches only where the decodes fill the GPU alone (no key splits) and the chunk is long: from a shorter
    # chunk over an FP8 cache (whose decode tiles differ most from a chunk's) than over a 16-bit one
    assert launch_apart(64, FP8_APART_MIN_CHUNK_TOKENS, 8, 132, kv_fp8=True)
    assert not launch_apart(64, FP8_APART_MIN_CHUNK_TOKENS, 8, 132, kv_fp8=False)
    assert launch_apart(64, LONG_CHUNK_TOKENS, 8, 132, kv_fp8=False)
    assert not launch_apart(16, 8192, 8, 132, kv_fp8=True)  # 128 decode programs leave SMs idle: one launch
    assert not launch_apart(64, FP8_APART_MIN_CHUNK_TOKENS - 1, 8, 132, kv_fp8=True)
    from metronome.kernels.triton_attention import paged_attention
    batch = make_paged_batch([1, 40], [30, 0], block_size=16, n_kv_heads=1, group=2, head_dim=64, seed=2)
    with pytest.raises(ValueError, match="do not split keys"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, num_splits=2, apart=True)
    # a long chunk beside decodes takes the chunk tiles; a short one keeps the mixed batch's
    pure_chunks = choose_config(False, True, False, 4, 128, on_cuda=True)
    assert choose_config(False, False, True, 4, 128, on_cuda=True, chunk_tokens=LONG_CHUNK_TOKENS) == pure_chunks
    assert choose_config(False, False, True, 4, 128, on_cuda=True, chunk_tokens=512) != pure_chunks
    # more decode programs than an SM holds at once: an FP8 cache's busy decode tiles fit one more by a register cap
    from metronome.kernels.triton_attention import FP8_QUEUED_DECODE_REGISTERS, QUEUED_PROGRAMS_PER_SM, batch_fill
    assert batch_fill(16, 8, 132) == (False, False) and batch_fill(64, 8, 132) == (True, False)
    assert batch_fill(QUEUED_PROGRAMS_PER_SM * 132 // 8, 8, 132) == (True, True)
    queued = choose_config(True, False, True, 4, 128, on_cuda=True, kv_fp8=True, queued=True)
    assert queued.max_registers == FP8_QUEUED_DECODE_REGISTERS
    assert queued == replace(choose_config(True, False, True, 4, 128, on_cuda=True, kv_fp8=True),
                             max_registers=FP8_QUEUED_DECODE_REGISTERS)
    assert choose_config(True, False, True, 4, 128, on_cuda=True, queued=True).max_registers == 0  # bf16 streams
    for decode_only, chunks_only, busy in [(True, False, True), (True, False, False), (False, True, False),
                                           (False, False, True)]:
        for group_pad in (1, 4, 8, 16):
            for kv_fp8 in (False, True):
                cfg = choose_config(decode_only, chunks_only, busy, group_pad, 128, on_cuda=True, kv_fp8=kv_fp8)
                assert cfg.block_m % group_pad == 0 and min(cfg.block_n, cfg.decode_block_n) >= 16

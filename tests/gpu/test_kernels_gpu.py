"""Attention kernels on CUDA: Triton (compiled) against the torch reference, with real model shapes.

Run on the GPU machine only: `.venv/bin/pytest -q tests/gpu/test_kernels_gpu.py` (never part of CI).
"""
from __future__ import annotations

import math

import pytest
import torch

from metronome.kernels import get_backend, select_backend
from metronome_testing.random_batch import make_paged_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}

# (name, q_lens, ctx_lens, block_size, n_kv_heads, group, head_dim)
SHAPES = [
    ("llama3_decode_b64_2k", [1] * 64, [2047 - 13 * i for i in range(64)], 16, 8, 4, 128),
    ("llama3_decode_b1_8k_splitk", [1], [8191], 16, 8, 4, 128),
    ("llama3_decode_b4_page256", [1] * 4, [4000, 257, 255, 3000], 256, 8, 4, 128),
    ("llama3_mixed_chunk512", [512] + [1] * 31, [1536] + [100 + 61 * i for i in range(31)], 16, 8, 4, 128),
    ("llama3_mixed_two_chunks_page64", [300, 1, 77, 1], [0, 2000, 1000, 63], 64, 8, 4, 128),
    ("smollm2_mixed_g3_d64", [200, 1, 1, 17], [0, 900, 31, 4], 16, 3, 3, 64),
    ("mha_g1_d64_mixed", [64, 1, 1], [2000, 15, 16], 16, 4, 1, 64),
    ("qwen_g7_d128_mixed", [33, 1], [500, 700], 16, 2, 7, 128),
    ("d96_mixed", [45, 1], [130, 64], 16, 2, 8, 96),
    ("prefill_2k_fresh", [2048], [0], 256, 8, 4, 128),
    # decodes that fill the GPU alone beside a long chunk: two launches (launch_apart)
    ("llama3_lead_decodes_chunk2100_apart", [1] * 24 + [2100, 1], [300 + 37 * i for i in range(24)] + [900, 40], 16,
     8, 4, 128),
]


def _run(backend_name: str, name, q_lens, ctx_lens, block_size, n_kv_heads, group, head_dim, dtype):
    batch = make_paged_batch(q_lens, ctx_lens, block_size, n_kv_heads, group, head_dim, dtype=dtype,
                             device="cuda", seed=len(name))
    backend = get_backend(backend_name)
    backend.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = backend.attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 1.0 / math.sqrt(head_dim))
    torch.cuda.synchronize()
    return out, batch.k_cache, batch.v_cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_triton_matches_torch_on_cuda(shape, dtype):
    out, k_cache, v_cache = _run("triton", *shape, dtype)
    ref, ref_k, ref_v = _run("torch", *shape, dtype)
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(out).all(), "triton read poisoned cache slots"
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 2, 8, 16])
def test_split_k_agrees_with_unsplit(num_splits):
    from metronome.kernels.triton_attention import paged_attention
    batch = make_paged_batch([1, 1, 9], [5000, 30, 700], 16, 8, 4, 128, dtype=torch.bfloat16, device="cuda")
    get_backend("triton").write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    ref = get_backend("torch").attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.088)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.088, num_splits=num_splits)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_strided_q_and_kv_views_of_a_fused_projection():
    """q/k/v as slices of one qkv tensor (as a model produces them) give the same result as contiguous copies."""
    batch = make_paged_batch([40, 1], [10, 300], 16, 2, 4, 64, dtype=torch.bfloat16, device="cuda")
    t, h, kvh, d = batch.q.shape[0], batch.q.shape[1], batch.key.shape[1], 64
    qkv = torch.cat([batch.q.reshape(t, -1), batch.key.reshape(t, -1), batch.value.reshape(t, -1)], dim=1)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=1)
    q, k, v = q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)
    backend = get_backend("triton")
    backend.write_kv(k, v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = backend.attention(q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    ref = get_backend("torch").attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_new_batch_shapes_do_not_recompile():
    """Decode batches of many sizes and contexts share one compiled kernel variant (no compile storms)."""
    from metronome.kernels.triton_attention import _paged_attention
    backend = get_backend("triton")

    def variants() -> int:
        return sum(len(caches[0]) for caches in _paged_attention.device_caches.values())

    def decode(batch_size: int, ctx: int) -> None:
        batch = make_paged_batch([1] * batch_size, [ctx] * batch_size, 16, 8, 4, 128, dtype=torch.bfloat16,
                                 device="cuda", seed=batch_size)
        backend.attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.088)

    decode(200, 100)
    before = variants()
    for batch_size, ctx in [(129, 90), (201, 33), (256, 17), (300, 64), (150, 230)]:  # table widths 7..16
        decode(batch_size, ctx)
    assert variants() == before


def test_auto_selection_on_cuda_picks_a_gpu_backend():
    from metronome.kernels.attention_choice import load_table
    from metronome.kernels.flash_attn_backend import fa4_importable

    expected = "auto" if load_table().uses_flash_attn and fa4_importable() else "triton"
    assert select_backend("cuda", 16, 128) == expected  # per batch class only where the table sends some to FA4

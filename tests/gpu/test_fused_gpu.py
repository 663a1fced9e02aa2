"""Fused element-wise kernels on CUDA against the torch path, at Llama-3-8B shapes in bf16, and the whole model
forward fused vs unfused.

Run on the GPU machine only: `pytest -q -s tests/gpu/test_fused_gpu.py` (never part of CI).
"""
from __future__ import annotations

import pytest
import torch

from metronome.kernels.metadata import scratch_metadata
from metronome.kernels.triton_fused import add_rms_norm, rope_write_kv, silu_mul
from metronome.server.models import load_model
from metronome.server.models.layers import RMSNorm
from metronome.server.models.presets import preset_config
from metronome.server.models.rope import RotaryEmbedding

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of elements that differ (NaN counts as differing)."""
    return (a != b).float().mean().item() if a.shape == b.shape else float("nan")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("tokens", [1, 64, 576])
def test_fused_kernels_round_like_torch_at_llama3_shapes(tokens):
    config = preset_config("llama-3-8b")
    h, heads, kv, d, inter = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                              config.head_dim, config.intermediate_size)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    dt = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dt)

    norm = RMSNorm(h, config.rms_norm_eps).to("cuda", dt)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * randn(h).float())
    x, residual = randn(tokens, h), randn(tokens, h)
    got_residual = residual.clone()
    got = add_rms_norm(x, got_residual, norm.weight, norm.eps)
    expected_norm = norm(residual + x)
    exact = {"residual": _mismatch(got_residual, residual + x)}  # the add rounds exactly as torch's
    norm_error = _rel(got, expected_norm)

    rotary = RotaryEmbedding(config)
    rotary.limit_positions(4096)
    cos, sin = rotary.tables(torch.device("cuda"), dt)
    positions = torch.randint(0, 4096, (tokens,), device="cuda", generator=g)
    blocks, page = 64, 16
    slots = torch.randperm(blocks * page, device="cuda", generator=g)[:tokens]
    if tokens > 1:
        slots[0] = -1
    qkv = randn(tokens, (heads + 2 * kv) * d)
    k_cache = torch.full((blocks, page, kv, d), float("nan"), dtype=dt, device="cuda")
    v_cache = k_cache.clone()
    q = rope_write_kv(qkv, positions, slots, cos, sin, k_cache, v_cache, heads, kv)
    q_part, k_part, _ = qkv.split([heads * d, kv * d, kv * d], -1)
    q_ref, k_ref = rotary(positions, q_part.reshape(tokens, heads, d), k_part.reshape(tokens, kv, d))
    keep = slots >= 0
    exact["q"] = _mismatch(q, q_ref)  # rope: every rounding as torch's, bit for bit
    exact["k"] = _mismatch(k_cache.view(-1, kv, d)[slots[keep]], k_ref[keep])
    exact["v"] = _mismatch(v_cache.view(-1, kv, d)[slots[keep]], qkv[:, (heads + kv) * d:].reshape(tokens, kv, d)[keep])
    written = torch.zeros(blocks * page, dtype=torch.bool, device="cuda")
    written[slots[keep]] = True
    untouched = bool(k_cache.view(-1, kv, d)[~written].isnan().all())

    gate_up = randn(tokens, 2 * inter)
    gate, up = gate_up.split(inter, -1)
    silu_error = _rel(silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    print(f"\n{tokens} tokens: norm rel {norm_error:.2e}, silu rel {silu_error:.2e}, elements differing from "
          f"torch: {exact}, skipped slots untouched: {untouched}")
    assert untouched and all(v == 0 for v in exact.values())
    assert norm_error < 1e-2 and silu_error < 1e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_forward_matches_the_torch_path(dtype):
    loaded = load_model("random:tiny", dtype=dtype, device="cuda", attention_backend="triton", seed=3, block_size=16)
    model = loaded.model
    config = loaded.config
    caches = [tuple(torch.zeros((65, 16, config.num_key_value_heads, config.head_dim), dtype=loaded.dtype,
                                device="cuda") for _ in range(2)) for _ in range(config.num_hidden_layers)]
    q_lens = [1, 37, 1, 90]
    meta = scratch_metadata(q_lens, 64, "cuda")
    # real slots and contexts: every sequence's tokens go to its own blocks
    slots, tables = [], []
    for b, n in enumerate(q_lens):
        tables.append([b * 8 + i for i in range(8)])
        slots += [(b * 8) * 16 + i for i in range(n)]
    meta.block_tables = torch.tensor(tables, dtype=torch.int32, device="cuda")
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device="cuda")
    ids = torch.randint(3, config.vocab_size, (sum(q_lens),), device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in q_lens])
    outs = {}
    for fused in (False, True):
        model.fused = fused
        with torch.inference_mode():
            outs[fused] = model.forward(ids, positions, caches, meta).float()
    model.fused = None
    error = _rel(outs[True], outs[False])
    print(f"\n{dtype}: fused vs torch path, final hidden rel {error:.2e}")
    assert torch.isfinite(outs[True]).all() and error < (1e-4 if dtype == "float32" else 2e-2)

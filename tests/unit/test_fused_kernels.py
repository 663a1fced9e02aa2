"""The fused element-wise kernels (kernels/triton_fused.py) against the torch path of the model, under Triton's
interpreter on the CPU.

As in test_kernels.py, the Triton side runs in a subprocess started with TRITON_INTERPRET=1 (this file run as a
script) and hands back plain numbers; the checks are here. Inputs are fresh random values (never zeros); caches
and outputs are poisoned with NaN first, so an unwritten element or a write to a skipped slot shows. The
interpreter converts to bf16 by truncation (the GPU rounds to nearest), so bit-exactness is checked here in fp32
and on the GPU in tests/gpu/test_fused_gpu.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# (name, tokens, hidden, heads, kv_heads, head_dim, block_size, variant, dtype). Variants: "llama"; "qwen3"
# (QK-norm); "gemma" (QK-norm and norms scaling by 1 + w, GELU-tanh gate); "phi" (rope over 3/4 of each head:
# 12 of 16 dims, a rotary half that is no power of two); "gpt_oss" (norms scaling by w in float32).
CASES = [
    ("f32_pow2", 7, 64, 4, 2, 16, 4, "llama", "float32"),
    ("f32_odd_hidden_gqa3", 5, 96, 3, 1, 32, 16, "llama", "float32"),
    ("bf16", 9, 128, 8, 2, 16, 8, "llama", "bfloat16"),
    ("f32_qwen3_qk_norm", 6, 64, 4, 2, 16, 4, "qwen3", "float32"),
    ("f32_gemma_d256", 4, 64, 2, 1, 256, 16, "gemma", "float32"),
    ("f32_phi_partial_rotary", 5, 64, 4, 4, 16, 8, "phi", "float32"),
    ("bf16_gemma", 6, 128, 4, 2, 32, 8, "gemma", "bfloat16"),
    ("bf16_gpt_oss", 5, 64, 8, 1, 16, 16, "gpt_oss", "bfloat16"),
]
VARIANTS = {"llama": {}, "qwen3": dict(qk_norm=True),
            "gemma": dict(qk_norm=True, norm_plus_one=True, hidden_act="gelu_tanh"),
            "phi": dict(partial_rotary_factor=0.75), "gpt_oss": dict(norm_float_scale=True)}
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case_results(name, tokens, hidden, heads, kv_heads, head_dim, block_size, variant, dtype_name) -> dict:
    from metronome.kernels.triton_fused import add_rms_norm, gated_act, rope_write_kv
    from metronome.server.models.config import ModelConfig
    from metronome.server.models.layers import RMSNorm
    from metronome.server.models.rope import RotaryEmbedding

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(len(name))

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    out: dict = {}
    features = VARIANTS[variant]
    plus_one = features.get("norm_plus_one", False)
    float_scale = features.get("norm_float_scale", False)
    # --- norm with and without the residual add
    norm = RMSNorm(hidden, 1e-5, plus_one, float_scale).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * randn(hidden).float())
    x, residual = randn(tokens, hidden), randn(tokens, hidden)
    expected_residual = residual + x
    expected = norm(expected_residual)
    got_residual = residual.clone()
    got = add_rms_norm(x, got_residual, norm.weight, norm.eps, plus_one=plus_one, float_scale=float_scale)
    out["residual_equal"] = torch.equal(got_residual, expected_residual)
    out["norm_add"] = _rel(got, expected)
    out["norm_plain"] = _rel(add_rms_norm(None, residual.clone(), norm.weight, norm.eps, plus_one=plus_one,
                                          float_scale=float_scale), norm(residual))

    # --- rope + K/V write
    config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=heads * head_dim, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
                         bos_token_id=None, eos_token_ids=(0,), **features)
    rotary = RotaryEmbedding(config)
    qk_norm = None
    q_norm, k_norm = RMSNorm(head_dim, 1e-6, plus_one).to(dtype), RMSNorm(head_dim, 1e-6, plus_one).to(dtype)
    if config.qk_norm:
        with torch.no_grad():
            q_norm.weight.copy_(0.1 * randn(head_dim).float() + (0.0 if plus_one else 1.0))
            k_norm.weight.copy_(0.1 * randn(head_dim).float() + (0.0 if plus_one else 1.0))
        qk_norm = (q_norm.weight, k_norm.weight, 1e-6, plus_one)
    num_blocks = 6
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[1] = -1  # skipped: its K/V must not be written anywhere
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    cos, sin = rotary.tables(torch.device("cpu"), dtype)
    q_out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype)
    rope_write_kv(qkv, positions, slots, cos, sin, k_cache, v_cache, heads, kv_heads, q_out, qk_norm=qk_norm)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    if qk_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q_ref, k_ref = rotary(positions, q, k)
    out["q"] = _rel(q_out, q_ref)
    keep = slots >= 0
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    out["k"] = _rel(flat_k[slots[keep]], k_ref[keep])
    out["v_equal"] = torch.equal(flat_v[slots[keep]], v.reshape(tokens, kv_heads, head_dim)[keep])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[slots[keep]] = True
    out["untouched_nan"] = bool(flat_k[~written].isnan().all() and flat_v[~written].isnan().all())

    # --- act(gate) * up
    inter = hidden + 3  # not a power of two: masked tail
    gate_up = randn(tokens, 2 * inter)
    gate, up = gate_up.split(inter, dim=-1)
    act = features.get("hidden_act", "silu")
    F = torch.nn.functional
    expected_act = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    out["gated_act"] = _rel(gated_act(gate_up, act), expected_act * up)
    out["finite"] = bool(torch.isfinite(q_out).all() and torch.isfinite(got).all())
    return out


MODEL_PRESETS = ("tiny", "tiny-qwen3", "tiny-gemma3", "tiny-phi3")


def _model_results(preset: str) -> dict:
    """A whole tiny model of each family, fused kernels and Triton attention against the torch path: a prefill of
    70 tokens (past the sliding layers' 48-token window) then one decode, logits compared."""
    from test_model_exact import PagedCache

    from metronome.kernels import get_backend
    from metronome.server.models import load_model

    loaded = load_model(f"random:{preset}", dtype="float32", device="cpu", attention_backend="torch", seed=1)
    model = loaded.model
    ids = torch.randint(3, loaded.config.vocab_size, (71,), generator=torch.Generator().manual_seed(2))
    logits = {}
    for fused in (False, True):
        model.fused = fused
        model.set_attention_backend(get_backend("triton" if fused else "torch"))
        cache = PagedCache(loaded.config, 1, 71)
        with torch.inference_mode():
            model(ids[:70], torch.arange(70), cache.kv, cache.metadata([0], [70]))
            hidden = model(ids[70:], torch.tensor([70]), cache.kv, cache.metadata([70], [1]))
            logits[fused] = model.compute_logits(hidden)
    return {"logits": _rel(logits[True], logits[False])}


def _run_all() -> dict:
    results = {case[0]: _case_results(*case) for case in CASES}
    results.update({f"model:{preset}": _model_results(preset) for preset in MODEL_PRESETS})
    return results


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, f"triton interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_kernels_match_the_torch_path(results, case):
    got = results[case[0]]
    tol = TOL[case[-1]]
    assert got["finite"]
    if case[-1] == "float32":  # Triton's interpreter truncates to bf16 where the GPU rounds (checked in tests/gpu)
        assert got["residual_equal"], "the residual add must round exactly as torch's"
    assert got["v_equal"], "v is copied, not computed"
    assert got["untouched_nan"], "a skipped slot (or a slot of no token) was written"
    for key in ("norm_add", "norm_plain", "q", "k", "gated_act"):
        assert got[key] < tol, (key, got[key])


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_fused_model_matches_the_torch_path(results, preset):
    assert results[f"model:{preset}"]["logits"] < 1e-5


if __name__ == "__main__":
    print(json.dumps(_run_all()))

"""The weight-only FP8 GEMM (kernels/triton_w8a16.py) and its fused inputs, under Triton's interpreter on the CPU,
against float32 torch: the plain input, the residual add with RMSNorm made in the K loop (and the new residual it
writes), SiLU·mul made in the K loop; and a whole FP8 model whose norms and MLPs hand their inputs over.

As in test_fp8_kernels.py the Triton side runs in a subprocess started with TRITON_INTERPRET=1 (this file run as a
script) and hands back plain numbers; the checks are here. Inputs are float32 (bf16 runs on the GPU:
tests/gpu/test_fp8_gpu.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# (name, rows, N, K, tiles (block_n, block_k)): K not a multiple of the K tile, N not one of the column tile,
# 1 to 16 rows
CASES = [("one_row", 1, 48, 200, (32, 64)), ("some_rows", 5, 40, 96, (32, 32)), ("full_tile", 16, 72, 64, (32, 64))]
EPS = 1e-5


def _operands(name, m, n, k):
    from metronome.server.models.quant import fp8

    g = torch.Generator().manual_seed(m * n + k)
    w, w_scale = fp8.quantize_per_channel(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g)
    return g, w, w_scale, bias, fp8.dequantize(w, w_scale[:, None])


def _rel(got, expected) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def _case_results(name, m, n, k, block) -> dict:
    from metronome.kernels.triton_fp8_skinny import SkinnyTiles
    from metronome.kernels.triton_w8a16 import add_rms_norm_w8a16, silu_mul_w8a16, w8a16_matmul

    tiles = SkinnyTiles(block[0], block[1], 4, 1)
    g, w, w_scale, bias, w_deq = _operands(name, m, n, k)
    x = torch.randn(m, k, generator=g) * 3
    plain = w8a16_matmul(x, w, w_scale, bias, tiles=tiles)
    scalar = w8a16_matmul(x, w, torch.tensor(0.5), tiles=tiles)

    residual = torch.randn(m, k, generator=g) * 4
    residual_before = residual.clone()
    delta = torch.randn(m, k, generator=g)
    norm_weight = 1 + 0.1 * torch.randn(k, generator=g)
    normed, new_residual = add_rms_norm_w8a16(delta, residual, norm_weight, EPS, w, w_scale, bias, tiles=tiles)
    s = residual_before + delta
    expected_norm = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight) @ w_deq.t() + bias
    alone, same_residual = add_rms_norm_w8a16(None, residual, norm_weight, EPS, w, w_scale, tiles=tiles)
    expected_alone = (residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight) @ w_deq.t()

    gate_up = torch.randn(m, 2 * k, generator=g) * 2
    silu = silu_mul_w8a16(gate_up, w, w_scale, bias, tiles=tiles)
    gate, up = gate_up.split(k, dim=-1)
    expected_silu = (torch.nn.functional.silu(gate) * up) @ w_deq.t() + bias
    return {"plain_rel": _rel(plain, x @ w_deq.t() + bias), "plain_shape": list(plain.shape),
            "scalar_rel": _rel(scalar, x @ (w.float() * 0.5).t()),
            "norm_rel": _rel(normed, expected_norm), "new_residual_equal": torch.equal(new_residual, s),
            "residual_untouched": torch.equal(residual, residual_before),
            "alone_rel": _rel(alone, expected_alone), "alone_keeps_residual": same_residual is residual,
            "silu_rel": _rel(silu, expected_silu)}


def _model_results() -> dict:
    """A tiny FP8 Llama on the fused path at 5 rows (the producers hand their inputs over: qkv_proj, gate_up_proj
    and down_proj run the weight-only GEMM) against the torch path with those three layers computing x @ the
    dequantised weight (unquantised_linear) and o_proj, whose bf16 input on the CPU is quantised either way, the
    FP8 emulation; and at 20 rows (above unquantised_rows: the producers quantise) against the plain torch path."""
    from test_model_exact import PagedCache

    from metronome.server.models import load_model
    from metronome.server.models.quant.fp8_linear import unquantised_linear
    from metronome.server.models.quant.fused_input import NormedInput, SiluMulInput

    loaded = load_model("random:tiny", dtype="float32", attention_backend="torch", seed=2, quantization="fp8")
    model = loaded.model
    layer = model.model.layers[0]
    handed = []
    for name in ("qkv_proj", "gate_up_proj", "down_proj"):
        linear = getattr(layer.self_attn if name == "qkv_proj" else layer.mlp, name)
        linear.register_forward_pre_hook(lambda module, args: handed.append(type(args[0]).__name__))

    def run(rows: int, fused: bool) -> torch.Tensor:
        model.fused = fused
        ids = torch.randint(3, loaded.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
        cache = PagedCache(loaded.config, 1, rows)
        with torch.inference_mode():
            return model.compute_logits(model(ids, torch.arange(rows), cache.kv, cache.metadata([0], [rows])))

    out = {"unquantised_rows": layer.input_layernorm.unquantised_rows}
    for rows in (5, 20):
        handed.clear()
        fused = run(rows, True)
        out[f"handed_{rows}"] = handed[:3]
        swapped = []
        if rows <= layer.input_layernorm.unquantised_rows:
            for block in model.model.layers:
                for linear in (block.self_attn.qkv_proj, block.mlp.gate_up_proj, block.mlp.down_proj):
                    linear.forward = lambda x, linear=linear: unquantised_linear(x, linear)
                    swapped.append(linear)
        reference = run(rows, False)
        for linear in swapped:
            del linear.forward
        out[f"diff_{rows}"] = (fused - reference).abs().max().item()
        out[f"scale_{rows}"] = reference.abs().max().item()
    out["types"] = [NormedInput.__name__, SiluMulInput.__name__]
    return out


def _run_all() -> dict:
    return {"cases": {c[0]: _case_results(*c) for c in CASES}, "model": _model_results()}


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", METRONOME_FP8_GEMM="w8a16")  # the model's layers take it
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, f"triton interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_weight_only_gemm_and_its_fused_inputs_match_float32(results, case):
    got = results["cases"][case[0]]
    assert got["plain_shape"] == [case[1], case[2]]
    for key in ("plain_rel", "scalar_rel", "norm_rel", "alone_rel", "silu_rel"):
        assert got[key] < 1e-5, (key, got)
    assert got["new_residual_equal"], "the first column tile writes residual + delta"
    assert got["residual_untouched"], "the residual every program reads is never written"
    assert got["alone_keeps_residual"], "without a delta the residual is the new residual"


def test_a_model_hands_its_producers_inputs_to_the_weight_only_gemm(results):
    got = results["model"]
    assert got["unquantised_rows"] >= 5
    normed, silu = got["types"]
    assert got["handed_5"] == [normed, normed, silu], got  # qkv_proj, gate_up_proj, down_proj of layer 0
    assert got["handed_20"] == ["Fp8Activation"] * 3, got
    for rows in (5, 20):
        assert got[f"diff_{rows}"] < 1e-4 * max(1.0, got[f"scale_{rows}"]), got


def test_the_weight_only_gemm_refuses_what_it_cannot_take():
    from metronome.kernels.triton_w8a16 import MAX_ROWS, add_rms_norm_w8a16, silu_mul_w8a16, w8a16_matmul
    from metronome.server.models.quant import fp8

    w, scale = fp8.quantize_per_channel(torch.randn(8, 32))
    with pytest.raises(ValueError, match="at most 16 rows"):
        w8a16_matmul(torch.randn(MAX_ROWS + 1, 32), w, scale)
    with pytest.raises(ValueError, match="e4m3 weight"):
        w8a16_matmul(torch.randn(2, 32), w.float(), scale)
    with pytest.raises(ValueError, match=r"weight \[N, 16\]"):
        silu_mul_w8a16(torch.randn(2, 32), w, scale)  # gate_up of 2 x 16 against a K of 32
    with pytest.raises(ValueError, match="one per weight row"):
        w8a16_matmul(torch.randn(2, 32), w, torch.ones(3))
    with pytest.raises(ValueError, match="does not match the residual"):
        add_rms_norm_w8a16(torch.randn(3, 32), torch.randn(2, 32), torch.ones(32), EPS, w, scale)
    residual = torch.randn(2, 32)
    with pytest.raises(ValueError, match="another tensor"):
        add_rms_norm_w8a16(torch.randn(2, 32), residual, torch.ones(32), EPS, w, scale, new_residual=residual)


def test_the_gemm_choice_takes_the_weight_only_kernel_at_the_smallest_batches():
    from metronome.server.models.quant.cuda_gemm import W8A16_ROWS, unquantised_rows
    from metronome.server.models.quant.fp8_linear import Fp8Linear
    from metronome.server.models.quant.scheme import Fp8Scheme

    def layer(gemm: str, weights: str = "channel") -> Fp8Linear:
        scheme = Fp8Scheme(source="online", weights=weights, activations="token",
                           block=(128, 128) if weights == "block" else None)
        linear = Fp8Linear(256, 256, bias=False, scheme=scheme, shard_sizes=(256,), dtype=torch.bfloat16)
        linear.gemm = gemm
        return linear

    assert [unquantised_rows(layer(g)) for g in ("w8a16", "skinny", "rowwise", "triton")] == [W8A16_ROWS, 0, 0, 0]
    assert unquantised_rows(layer("w8a16", "block")) == 0  # block scales stay with the FP8 kernel


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(_run_all()))

"""The FP8 Triton kernels (kernels/triton_fp8.py, the FP8 functions of kernels/triton_fused.py) against the torch
reference of metronome.server.models.quant, under Triton's interpreter on the CPU.

As in test_fused_kernels.py, the Triton side runs in a subprocess started with TRITON_INTERPRET=1 (this file run
as a script) and hands back plain numbers; the checks are here. Quantisation is compared bit for bit (the
kernels round to the e4m3 grid in integer arithmetic, as torch's cast does); the norm and SiLU·mul inputs are
float32 so the interpreter's bf16 truncation stays out of it (bf16 runs on the GPU: tests/gpu/test_fp8_gpu.py).
The GEMM is compared with the float32 emulation of the same FP8 operands.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# (name, tokens, width, group) — widths with a short last group (200 = 3 x 64 + 8) and rows of several chunks;
# "bounded": per token with each token's amax bounded (FBGEMM's activation_scale_ub), below most rows' amax
QUANT_CASES = [("token", 5, 200, None), ("group", 4, 200, 64), ("static", 3, 96, "static"),
               ("token_wide", 2, 2500, None), ("bounded", 5, 200, "bounded"), ("bounded_wide", 2, 2500, "bounded")]
AMAX_UB = 0.7
# (name, M, N, K, mode, kernel) — mode: tensor (0-d scales), token_channel ([M, 1] x [N]), block (groups of 32
# along K); kernel: the tiled FP8 GEMM or the small-M one (kernels/triton_fp8_skinny.py: K not a multiple of its
# tile, N not a multiple of its column tile, 1 to 33 rows)
GEMM_CASES = [("tensor", 5, 48, 64, "tensor", "tiled"), ("token_channel", 19, 40, 96, "token_channel", "tiled"),
              ("block", 33, 64, 80, "block", "tiled"), ("bias", 7, 32, 32, "bias", "tiled"),
              ("skinny_token_channel", 1, 48, 200, "token_channel", "skinny"),
              ("skinny_tensor", 5, 40, 96, "tensor", "skinny"), ("skinny_bias", 33, 72, 64, "bias", "skinny"),
              ("skinny_split2", 3, 72, 200, "bias", "skinny-split2"),
              ("skinny_split3", 1, 48, 200, "token_channel", "skinny-split3")]  # 4 K tiles: the third split empty


def _quant_results(name, tokens, width, group) -> dict:
    from metronome.kernels.triton_fp8 import quantize_fp8
    from metronome.server.models.quant import fp8

    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(tokens, width, generator=g) * torch.exp(torch.randn(tokens, 1, generator=g))
    x[0, :7] = torch.tensor([0.0, -0.0, 1e-9, 2 ** -10, 124.3, -3e-3, 1.0])  # zeros, subnormals, a carry
    if group == "static":
        scale = torch.tensor(0.01)
        q, s = quantize_fp8(x, static_scale=scale)
        rq, rs = fp8.quantize_per_tensor(x, scale)
    elif group is None:
        q, s = quantize_fp8(x, chunk=256)
        rq, rs = fp8.quantize_per_token(x)
    elif group == "bounded":
        q, s = quantize_fp8(x, chunk=256, amax_ub=AMAX_UB)
        rq, rs = fp8.quantize_per_token(x, AMAX_UB)
    else:
        q, s = quantize_fp8(x, group=group)
        rq, rs = fp8.quantize_per_group(x, group)
    return {"q_equal": torch.equal(q.view(torch.uint8), rq.view(torch.uint8)),
            "scale_equal": torch.equal(s.reshape(rs.shape), rs)}


def _fused_results() -> dict:
    from metronome.kernels.triton_fused import add_rms_norm_fp8, silu_mul_fp8
    from metronome.server.models.layers import RMSNorm
    from metronome.server.models.quant import fp8

    g = torch.Generator().manual_seed(11)
    out: dict = {}
    hidden, inter, tokens = 192, 300, 6
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(hidden, generator=g))
    x, residual = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g)
    expected = norm(residual + x)
    for label, group, bound in (("token", None, None), ("group", 64, None), ("bounded", None, AMAX_UB)):
        got_residual = residual.clone()
        q, s = add_rms_norm_fp8(x, got_residual, norm.weight, norm.eps, group=group, amax_ub=bound)
        rq, rs = (fp8.quantize_per_token(expected, bound) if group is None
                  else fp8.quantize_per_group(expected, group))
        # the kernel's rsqrt and sum order may move a value across a rounding boundary: count, don't demand 0
        out[f"norm_{label}_q_mismatch"] = (q.float() != rq.float()).float().mean().item()
        out[f"norm_{label}_scale_rel"] = ((s.reshape(rs.shape) - rs).abs() / rs).max().item()
        out[f"norm_{label}_residual_equal"] = torch.equal(got_residual, residual + x)
    q, s = add_rms_norm_fp8(None, residual.clone(), norm.weight, norm.eps, static_scale=torch.tensor(0.02))
    rq, _ = fp8.quantize_per_tensor(norm(residual), torch.tensor(0.02))
    out["norm_static_q_mismatch"] = (q.float() != rq.float()).float().mean().item()

    gate_up = torch.randn(tokens, 2 * inter, generator=g)
    gate, up = gate_up.split(inter, dim=-1)
    product = torch.nn.functional.silu(gate) * up
    # chunk 128: per-token rows in two streaming passes; the default: each row whole in one program's registers
    for label, group, static, chunk, bound in (
            ("token", None, None, 128, None), ("token_whole", None, None, None, None), ("group", 64, None, 128, None),
            ("static", None, torch.tensor(0.01), 128, None), ("bounded", None, None, 128, AMAX_UB),
            ("bounded_whole", None, None, None, AMAX_UB)):
        q, s = silu_mul_fp8(gate_up, group=group, static_scale=static, amax_ub=bound,
                            **({"chunk": chunk} if chunk else {}))
        if static is not None:
            rq, rs = fp8.quantize_per_tensor(product, static)
        elif group is None:
            rq, rs = fp8.quantize_per_token(product, bound)
        else:
            rq, rs = fp8.quantize_per_group(product, group)
        out[f"silu_{label}_q_mismatch"] = (q.float() != rq.float()).float().mean().item()
        out[f"silu_{label}_scale_rel"] = ((s.reshape(rs.shape) - rs).abs() / rs).max().item()
    return out


def _gemm_results(name, m, n, k, mode, kernel) -> dict:
    from metronome.kernels.triton_fp8 import fp8_matmul
    from metronome.kernels.triton_fp8_skinny import SkinnyTiles, fp8_skinny_matmul
    from metronome.server.models.quant import fp8

    if kernel.startswith("skinny"):
        split = int(kernel.removeprefix("skinny-split") or 1) if "split" in kernel else 1

        def fp8_matmul(a, sa, b, sb, out_dtype, bias=None):  # noqa: F811 - the same call, the small-M kernel
            return fp8_skinny_matmul(a, sa, b, sb, out_dtype, bias, tiles=SkinnyTiles(32, 64, 4, 1, split))

    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = None
    if mode in ("tensor", "bias"):
        a, sa = fp8.quantize_per_tensor(x)
        b, sb = fp8.quantize_per_tensor(w)
        expected = fp8.dequantize(a, sa) @ fp8.dequantize(b, sb).t()
        if mode == "bias":
            bias = torch.randn(n, generator=g)
            expected = expected + bias
        got = fp8_matmul(a, sa, b, sb, torch.float32, bias)
    elif mode == "token_channel":
        a, sa = fp8.quantize_per_token(x)
        b, sb = fp8.quantize_per_channel(w)
        expected = fp8.dequantize(a, sa) @ fp8.dequantize(b, sb[:, None]).t()
        got = fp8_matmul(a, sa, b, sb, torch.float32)
    else:
        a, sa = fp8.quantize_per_group(x, 32)
        b, sb_blocks = fp8.quantize_per_block(w, (16, 32))
        sb = sb_blocks.repeat_interleave(16, dim=0)[:n]  # one row of block scales per weight row
        expected = (fp8.dequantize(a, fp8.expand_groups(sa, k, 32))
                    @ fp8.dequantize(b, fp8.expand_blocks(sb_blocks, (n, k), (16, 32))).t())
        got = fp8_matmul(a, sa, b, sb, torch.float32, group_k=32)
    out = {"rel": ((got - expected).norm() / expected.norm()).item(), "shape": list(got.shape)}
    if "split" in kernel:  # a second launch: the fix-up left its arrival counts at zero for it
        from metronome.kernels.triton_fp8_skinny import arrival_counts
        out["counts_zero"] = int(arrival_counts(a.device, 1).abs().sum())
        out["again_equal"] = torch.equal(fp8_matmul(a, sa, b, sb, torch.float32, bias), got)
    return out


def _model_results() -> dict:
    """A whole FP8 model with the fused kernels (norms and SiLU·mul hand FP8 activations to the next layer)
    against the same model on the torch path (each linear quantises its own input)."""
    from test_model_exact import PagedCache

    from metronome.server.models import load_model
    from metronome.server.models.quant.model_pass import Fp8OutputGatedMLP, Fp8OutputRMSNorm

    loaded = load_model("random:tiny", dtype="float32", attention_backend="torch", seed=2, quantization="fp8")
    layer = loaded.model.model.layers[0]
    classes = [type(layer.input_layernorm), type(layer.post_attention_layernorm), type(layer.mlp)]
    ids = torch.randint(3, loaded.config.vocab_size, (13,), generator=torch.Generator().manual_seed(5))
    logits = {}
    for fused in (False, True):
        loaded.model.fused = fused
        cache = PagedCache(loaded.config, 1, len(ids))
        with torch.inference_mode():
            hidden = loaded.model(ids, torch.arange(len(ids)), cache.kv, cache.metadata([0], [len(ids)]))
            logits[fused] = loaded.model.compute_logits(hidden)
    return {"producers_fuse": classes == [Fp8OutputRMSNorm, Fp8OutputRMSNorm, Fp8OutputGatedMLP],
            "max_diff": (logits[True] - logits[False]).abs().max().item(),
            "scale": logits[False].abs().max().item()}


def _run_all() -> dict:
    return {"quant": {c[0]: _quant_results(*c) for c in QUANT_CASES}, "fused": _fused_results(),
            "gemm": {c[0]: _gemm_results(*c) for c in GEMM_CASES}, "model": _model_results()}


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, f"triton interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", QUANT_CASES, ids=[c[0] for c in QUANT_CASES])
def test_quantize_kernel_is_bit_exact(results, case):
    got = results["quant"][case[0]]
    assert got["q_equal"], "FP8 codes differ from torch's rounding"
    assert got["scale_equal"], "scales differ from amax / 448"


def test_norm_and_silu_mul_quantise_their_output(results):
    got = results["fused"]
    for label in ("token", "group", "bounded"):
        assert got[f"norm_{label}_residual_equal"]
        assert got[f"norm_{label}_q_mismatch"] < 0.01, got
        assert got[f"norm_{label}_scale_rel"] < 1e-5, got
    assert got["norm_static_q_mismatch"] < 0.01, got
    for label in ("token", "token_whole", "group", "static", "bounded", "bounded_whole"):
        assert got[f"silu_{label}_q_mismatch"] < 0.01, got
    for label in ("token", "token_whole", "group", "bounded", "bounded_whole"):
        assert got[f"silu_{label}_scale_rel"] < 1e-5, got


@pytest.mark.parametrize("case", GEMM_CASES, ids=[c[0] for c in GEMM_CASES])
def test_fp8_matmul_matches_the_emulation(results, case):
    got = results["gemm"][case[0]]
    assert got["shape"] == [case[1], case[2]]
    assert got["rel"] < 1e-5, got
    if "split" in case[5]:
        assert got["counts_zero"] == 0 and got["again_equal"], got


def test_fused_fp8_model_equals_the_unfused_one(results):
    got = results["model"]
    assert got["producers_fuse"], "the norms and the MLP should hand FP8 activations over"
    assert got["max_diff"] < 1e-4 * max(1.0, got["scale"]), got


def test_kernels_refuse_bad_arguments(monkeypatch):
    from metronome.kernels.triton_fp8 import check_quant_args

    with pytest.raises(ValueError, match="power of two"):
        check_quant_args(100, 100, None)
    with pytest.raises(ValueError, match="no groups"):
        check_quant_args(128, 64, torch.tensor(1.0))
    with pytest.raises(ValueError, match="one float32"):
        check_quant_args(128, None, torch.ones(2))
    with pytest.raises(ValueError, match="per-token FP8 scales only"):
        check_quant_args(128, 64, None, amax_ub=1200.0)
    with pytest.raises(ValueError, match="positive finite"):
        check_quant_args(128, None, None, amax_ub=float("inf"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(_run_all()))


def test_the_gemm_choice_by_rows():
    from metronome.kernels.fp8_tiles import matmul_tiles
    from metronome.server.models.quant.cuda_gemm import SKINNY_ROWS, TRITON_ROWS, per_token_path

    rows = (1, SKINNY_ROWS, SKINNY_ROWS + 1, TRITON_ROWS, TRITON_ROWS + 1, 8192)
    assert [per_token_path("auto", m) for m in rows] == ["skinny", "skinny", "rowwise", "rowwise", "triton", "triton"]
    # one scale per operand: the per-tensor _scaled_mm at every size above the skinny rows
    assert per_token_path("auto", 8192, scalar_scales=True) == "rowwise"
    assert per_token_path("skinny", 4096) == "rowwise"  # the small-M kernel only where its rows fit
    # the Triton kernel's wide tiles serve exactly the rows `auto` sends it
    assert matmul_tiles(TRITON_ROWS)[:2] == (128, 128) and matmul_tiles(TRITON_ROWS + 1)[:2] == (128, 256)
    assert [per_token_path(c, 1) for c in ("rowwise", "tensorwise", "triton")] == ["rowwise", "tensorwise", "triton"]


def test_the_wide_tiles_give_way_where_their_last_wave_is_mostly_empty():
    from metronome.kernels.fp8_tiles import NARROW, WIDE, matmul_tiles, wave_efficiency

    assert wave_efficiency(192, 132) == 192 / 264 and wave_efficiency(132, 132) == 1.0
    # Llama-3-8B on an H200's 132 SMs, as measured (docs/perf/fp8-h200.md): qkv_proj (6,144 wide) in the 960-row
    # bucket of a saturated decode batch runs 128 x 128 tiles; larger batches, and every other weight, 128 x 256
    assert matmul_tiles(960, 6144, 132) == NARROW and matmul_tiles(1024, 6144, 132) == NARROW
    assert all(matmul_tiles(m, 6144, 132) == WIDE for m in (2048, 4096, 8192))
    assert all(matmul_tiles(m, n, 132) == WIDE for m in (960, 1024, 8192) for n in (4096, 28672))
    assert matmul_tiles(960, 6144) == WIDE  # the SM count unknown (not on CUDA): the wide tiles
    # eager steps (above the piecewise graphs' buckets) stay on the wide tiles their captures compiled
    assert matmul_tiles(4097 + 128 * 131, 128 * 2, 132) == WIDE
    assert matmul_tiles(4096 - 128 * 4, 128 * 2, 132) == NARROW  # 56 narrow tiles busy twice the SMs of 28 wide
    assert matmul_tiles(64, 6144, 132)[:2] == (64, 128)  # decode batches keep their small tiles


def test_the_skinny_tiles_by_weight_width():
    from metronome.kernels.triton_fp8_skinny import (
        DEFAULT_TILES,
        SPLIT_TILES,
        WIDE_TILES,
        WIDE_TILES_FEW_ROWS,
        choose_tiles,
    )

    # Llama-3-8B on an H200 (132 SMs): qkv, o and down stay under one wave of programs, gate_up spans several
    for n, k in ((6144, 4096), (4096, 4096)):
        assert {choose_tiles(n, k, m, 132) for m in (1, 16, 64)} == {DEFAULT_TILES}
    assert [choose_tiles(28672, 4096, m, 132) for m in (1, 16, 17, 64)] == [WIDE_TILES_FEW_ROWS] * 2 + [WIDE_TILES] * 2
    assert choose_tiles(28672, 4096, 1, 264) == DEFAULT_TILES  # twice the SMs: the same weight is narrow again
    # down_proj (K = 3.5 N) splits its K range over two programs above 32 rows, while the split fits one wave
    assert [choose_tiles(4096, 14336, m, 132) for m in (1, 16, 32, 33, 64)] == [DEFAULT_TILES] * 3 + [SPLIT_TILES] * 2
    assert choose_tiles(8192, 28672, 64, 132) == DEFAULT_TILES  # 128 column tiles: two programs each would not fit
    assert SPLIT_TILES.split_k == 2
    assert WIDE_TILES.num_stages < DEFAULT_TILES.num_stages

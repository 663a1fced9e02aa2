"""The MoE expert paths on CUDA: the fused Triton kernels and torch's grouped GEMM against the reference loop at
real model shapes (bf16), every family's block against transformers' on the GPU with the hidden routing cases,
CUDA-graph replay against eager, and no Triton compile for a new routing or a new token count of a known tile
class.

Run on the GPU machine only: `pytest -q -s tests/gpu/test_moe_gpu.py` (never part of CI).
"""
from __future__ import annotations

import pytest
import torch

from metronome.kernels.triton_moe import choose_tiles, fused_experts
from metronome.server.models.moe_config import MoeSpec
from metronome.server.models.moe_experts import (
    ExpertWeights,
    experts_grouped_mm,
    experts_reference,
    grouped_mm_available,
)
from metronome_testing.moe_cases import CASES, FAMILIES, build_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (name, experts, top_k, hidden, expert size, gpt-oss activation and biases)
SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768, False), ("gpt-oss-20b", 32, 4, 2880, 2880, True),
          ("mixtral-8x7b", 8, 2, 4096, 14336, False)]
PATHS = ["triton"] + (["grouped_mm"] if grouped_mm_available() else [])


def _spec(experts, top_k, inter, gpt_oss) -> MoeSpec:
    if gpt_oss:
        return MoeSpec(experts, top_k, inter, topk_before_softmax=True, weights_in_model_dtype=True,
                       router_bias=True, expert_bias=True, activation="swiglu_clamped",
                       checkpoint_layout="interleaved_transposed")
    return MoeSpec(experts, top_k, inter, weights_in_model_dtype=True)


def _layer(experts, hidden, inter, gpt_oss, seed=0) -> ExpertWeights:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*size):
        return (torch.randn(*size, generator=g, device="cuda") * 0.02).to(torch.bfloat16)

    return ExpertWeights(randn(experts, 2 * inter, hidden), randn(experts, hidden, inter),
                         randn(experts, 2 * inter) if gpt_oss else None, randn(experts, hidden) if gpt_oss else None)


def _routing(tokens, experts, top_k, hidden, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g, device="cuda"), -1).to(torch.bfloat16)
    return x, weights, ids


def _run(path, x, layer: ExpertWeights, weights, ids, spec):
    if path == "grouped_mm":
        return experts_grouped_mm(x, layer, weights, ids, spec)
    return fused_experts(x, layer.gate_up, layer.down, weights, ids, spec.activation, spec.swiglu_alpha,
                         spec.swiglu_limit, layer.gate_up_bias, layer.down_bias)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_fused_paths_match_the_reference_at_model_shapes(shape):
    name, experts, top_k, hidden, inter, gpt_oss = shape
    spec = _spec(experts, top_k, inter, gpt_oss)
    layer = _layer(experts, hidden, inter, gpt_oss)
    for tokens in (1, 7, 64, 256, 1000):
        x, weights, ids = _routing(tokens, experts, top_k, hidden, tokens)
        expected = experts_reference(x, layer, weights, ids, spec)
        for path in PATHS:
            got = _run(path, x, layer, weights, ids, spec)
            error = _rel(got, expected)
            print(f"{name} T={tokens} {path}: relative error {error:.2e}")
            assert torch.isfinite(got).all() and got.dtype == torch.bfloat16
            assert error < 1e-2, (name, tokens, path, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_match_transformers_on_the_gpu_with_the_hidden_routing_cases(family, dtype):
    for case, tokens in CASES:
        _, ours, x, expected = build_case(family, case, tokens, dtype, device="cuda")
        with torch.no_grad():
            for path in ["reference"] + PATHS:
                if path == "grouped_mm" and dtype == torch.float32:
                    continue  # torch's grouped GEMM takes bf16 on CUDA
                got = ours.run(x, path)
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                assert _rel(got, expected) < tol, (family, case, path)


@pytest.mark.parametrize("path", PATHS)
def test_graph_replay_equals_eager(path):
    """Captured once on static buffers, replayed after the inputs (and so the routing) change in place: the
    same numbers as an eager call on the new inputs."""
    _, experts, top_k, hidden, inter, gpt_oss = SHAPES[0]
    spec = _spec(experts, top_k, inter, gpt_oss)
    layer = _layer(experts, hidden, inter, gpt_oss)
    x, weights, ids = _routing(64, experts, top_k, hidden, 1)
    _run(path, x, layer, weights, ids, spec)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(path, x, layer, weights, ids, spec)
    for seed in (2, 3):
        new_x, new_weights, new_ids = _routing(64, experts, top_k, hidden, seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _run(path, x, layer, weights, ids, spec)), seed


def test_no_triton_compile_for_new_routings_or_token_counts_of_a_known_tile_class():
    from metronome.kernels import compile_watch

    if not compile_watch.install():
        pytest.skip("this Triton has no compile hook")
    _, experts, top_k, hidden, inter, gpt_oss = SHAPES[0]
    spec = _spec(experts, top_k, inter, gpt_oss)
    layer = _layer(experts, hidden, inter, gpt_oss)
    assert choose_tiles(40, top_k, experts, True) == choose_tiles(64, top_k, experts, True)
    x, weights, ids = _routing(64, experts, top_k, hidden, 1)
    _run("triton", x, layer, weights, ids, spec)
    torch.cuda.synchronize()
    compiled = compile_watch.count()
    for tokens, seed in ((64, 5), (40, 6), (63, 7)):
        x, weights, ids = _routing(tokens, experts, top_k, hidden, seed)
        _run("triton", x, layer, weights, ids, spec)
    torch.cuda.synchronize()
    assert compile_watch.count() == compiled

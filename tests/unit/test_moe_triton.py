"""The fused MoE kernels (kernels/triton_moe.py) against transformers' blocks and our reference loop, under Triton's
interpreter on the CPU.

As in test_fused_kernels.py, the Triton side runs in a subprocess started with TRITON_INTERPRET=1 (this file run as
a script) and hands back plain numbers; the checks are here. Each activation runs every routing case of
metronome_testing.moe_cases in float32 (the hidden ones included: ties, every token on the same experts, fewer pairs
than experts, one token), the other families the cases that shape the segments, and two cases run in bf16; the
alignment kernels are checked on their own for invariants at real expert counts, several block sizes and several
chunks; whole tiny MoE models (gpt-oss: sinks, windows, float32-scaled norms; Qwen3-MoE: QK-norm, a dense layer) run
their fused path against their torch path; and FP8 experts (per-row and block scales) run the fused kernels against
the reference loop on their dequantised weights. The epilogues round in integer arithmetic, so bf16 rounds here as
on the GPU; it is compared with a one-step tolerance (the token's k outputs are summed in float32, see
test_moe_block.py), and tests/gpu/test_moe_gpu.py repeats this on the H200.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# (num_experts, tokens, top_k, block_m, routing): "random" | "same" (every pair on expert E-1) | "two"
ALIGN_CASES = [(128, 1, 8, 16, "random"), (128, 50, 8, 16, "random"), (128, 3, 8, 64, "same"),
               (8, 300, 2, 16, "random"), (8, 300, 2, 128, "two"), (60, 5, 4, 32, "random")]
# Every routing case for the two activations (Qwen3-MoE: SiLU, top-3; gpt-oss: clamped SwiGLU with biases), the
# segment shapes that matter for the other two, two cases in bf16.
FULL_FAMILIES = ("qwen3_moe", "gpt_oss")
OTHER_CASES = ("random", "same_experts", "fewer_pairs_than_experts")
BF16_CASES = ("random", "tied_logits")
MODEL_PRESETS = ("tiny-gpt-oss", "tiny-qwen3-moe")
# FP8 experts (W8A16): scales per row, per 32 x 32 block, and per 16 x 16 block (groups narrower than the
# interpreter's 32-column K step: the kernel takes 16-column steps); gpt-oss adds its biases.
FP8_CASES = [("qwen3_moe", None), ("qwen3_moe", (32, 32)), ("gpt_oss", (16, 16))]


def _align_case(num_experts, tokens, top_k, block_m, routing) -> dict:
    from metronome.kernels.triton_moe import align_routes, max_row_blocks

    g = torch.Generator().manual_seed(tokens + num_experts)
    if routing == "random":
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    elif routing == "same":
        ids = torch.full((tokens, top_k), num_experts - 1)
        ids[:, 1:] = torch.arange(top_k - 1)
    else:
        ids = torch.tensor([[0, 5]] * tokens)
    plan = align_routes(ids, num_experts, block_m)
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    padded = int(plan.num_padded)
    pairs = plan.sorted_pairs[:padded]
    real = pairs[pairs < num_pairs]
    blocks_used = padded // block_m
    owners = plan.block_experts[:blocks_used].long()
    slot_owner = owners.repeat_interleave(block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    return {
        "num_m_blocks": plan.num_m_blocks,
        "worst_case": max_row_blocks(num_pairs, num_experts, block_m),
        "padded": padded,
        "expected_padded": int(((counts + block_m - 1) // block_m * block_m).sum()),
        "each_pair_once": sorted(real.tolist()) == list(range(num_pairs)),
        "padding_is_sentinel": bool((pairs[pairs >= num_pairs] == num_pairs).all()),
        "pairs_in_their_expert_block": bool((flat[pairs[pairs < num_pairs].long()] ==
                                             slot_owner[pairs < num_pairs]).all()),
        "segment_order_is_pair_order": all(
            bool((pairs[slot_owner == e][:int(counts[e])].diff() > 0).all()) for e in range(num_experts)),
        "owners_ascending": bool((owners.diff() >= 0).all()),
    }


def _block_case(family: str, case: str, tokens: int, dtype: torch.dtype, tiles=None) -> dict:
    from metronome.kernels.triton_moe import fused_experts
    from metronome_testing.moe_cases import build_case

    _, ours, x, expected = build_case(family, case, tokens, dtype)
    with torch.no_grad():
        weights, ids = ours.gate(x)
        reference = ours.routed(x, weights, ids, "reference")
        e = ours.experts
        spec = ours.spec
        got = fused_experts(x, e.gate_up_proj, e.down_proj, weights, ids, spec.activation, spec.swiglu_alpha,
                            spec.swiglu_limit, e.gate_up_proj_bias, e.down_proj_bias, tiles=tiles)
        block = ours.run(x, "triton")
    scale = expected.abs().max().item()
    return {
        "vs_reference": (got.float() - reference.float()).abs().max().item() / scale,
        "block_vs_transformers": (block.float() - expected.float()).abs().max().item() / scale,
        "finite": bool(torch.isfinite(block).all()),
        "dtype_kept": block.dtype == dtype,
    }


def _direct_plan() -> dict:
    """align_routes for one row block a pair: the routing ids as the block experts, nothing sorted or padded."""
    from metronome.kernels.triton_moe import align_routes

    ids = torch.tensor([[5, 1, 7], [1, 2, 5]])
    plan = align_routes(ids, 8, 1)
    return {"sorted": plan.sorted_pairs is not None, "padded": plan.num_padded is not None,
            "blocks": plan.num_m_blocks, "experts": plan.block_experts.tolist()}


def _fp8_block_case(family: str, block: tuple[int, int] | None, tokens: int = 40, tiles=None) -> dict:
    """A block's experts quantised to e4m3 (per row, or per block) the way a checkpoint stores them: the fused
    kernels on the FP8 weights against the reference loop on the same weights dequantised."""
    from metronome.kernels.triton_moe import Fp8ExpertScales, fused_experts
    from metronome.server.models.quant import fp8
    from metronome_testing.moe_cases import build_case

    _, ours, x, _ = build_case(family, "many_tokens", 40, torch.float32)
    x = x[:tokens]
    experts = ours.experts
    with torch.no_grad():
        weights, ids = ours.gate(x)
        unquantised = ours.routed(x, weights, ids, "reference")
    originals = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    experts.store_fp8(block)
    for stored, scales, original in ((experts.gate_up_proj, experts.gate_up_scale, originals[0]),
                                     (experts.down_proj, experts.down_scale, originals[1])):
        for expert, matrix in enumerate(original):
            q, scale = fp8.quantize_per_block(matrix, block) if block else fp8.quantize_per_channel(matrix)
            stored.data[expert] = q
            scales.data[expert] = experts.scale_rows(scale, *matrix.shape)
    with torch.no_grad():
        reference = ours.routed(x, weights, ids, "reference")
        if tiles is None:
            fused = ours.routed(x, weights, ids, "triton")
        else:
            fused = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, ours.spec.activation,
                                  tiles=tiles, fp8_scales=Fp8ExpertScales(experts.gate_up_scale, experts.down_scale))
    scale = reference.abs().max().item()
    return {"vs_reference": (fused - reference).abs().max().item() / scale, "finite": bool(fused.isfinite().all()),
            "fp8": experts.gate_up_proj.dtype == torch.float8_e4m3fn,
            "fp8_error": (reference - unquantised).abs().max().item() / scale}


def _model_case(preset: str) -> dict:
    """A whole MoE model on its fused path (Triton attention with sinks and windows, fused norms and rope, the
    fused experts) against its torch path, same weights: a mixed batch (a 30-token chunk and a 5-token prompt),
    then a decode step of both."""
    from test_model_exact import PagedCache

    from metronome.kernels import get_backend
    from metronome.server.models import load_model

    loaded = load_model(f"random:{preset}", dtype="float32", device="cpu", attention_backend="torch", seed=4)
    model = loaded.model
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, loaded.config.vocab_size, (n,), generator=g) for n in (30, 5)]
    logits = {}
    for fused in (False, True):
        model.fused = fused
        model.set_attention_backend(get_backend("triton" if fused else "torch"))
        cache = PagedCache(loaded.config, 2, 64)
        with torch.inference_mode():
            hidden = model(torch.cat(prompts), torch.cat([torch.arange(30), torch.arange(5)]), cache.kv,
                           cache.metadata([0, 0], [30, 5]))
            first = model.compute_logits(hidden)
            nxt = first[[29, 34]].argmax(-1)
            hidden = model(nxt, torch.tensor([30, 5]), cache.kv, cache.metadata([30, 5], [1, 1]))
            logits[fused] = torch.cat([first, model.compute_logits(hidden)])
    return {"rel": ((logits[True] - logits[False]).norm() / logits[False].norm()).item(),
            "finite": bool(torch.isfinite(logits[True]).all())}


def _run_all() -> dict:
    from metronome.kernels.triton_moe import MoeTiles
    from metronome_testing.moe_cases import CASES, FAMILIES

    out: dict = {"align": [_align_case(*case) for case in ALIGN_CASES], "blocks": {},
                 "models": {preset: _model_case(preset) for preset in MODEL_PRESETS},
                 "fp8": [_fp8_block_case(*case) for case in FP8_CASES]}
    for family in FAMILIES:
        for case, tokens in CASES:
            if family in FULL_FAMILIES or case in OTHER_CASES:
                out["blocks"][f"{family}/{case}/f32"] = _block_case(family, case, tokens, torch.float32)
            if family in FULL_FAMILIES and case in BF16_CASES:
                out["blocks"][f"{family}/{case}/bf16"] = _block_case(family, case, tokens, torch.bfloat16)
    # each pair its own row block (a decode step's plan): the one-token and few-pair cases, every family's epilogue
    single = MoeTiles(1, 16, 16, group_m=1, num_stages=1)
    for family, case, tokens in (("qwen3_moe", "single_token", 1), ("gpt_oss", "fewer_pairs_than_experts", 3),
                                 ("mixtral", "same_experts", 9)):
        out["blocks"][f"{family}/{case}/f32/single"] = _block_case(family, case, tokens, torch.float32, single)
    out["blocks"]["gpt_oss/single_token/bf16/single"] = _block_case("gpt_oss", "single_token", 1, torch.bfloat16,
                                                                    single)
    out["fp8"].append(_fp8_block_case("qwen3_moe", None, tokens=2, tiles=single))
    out["direct_plan"] = _direct_plan()
    wide = MoeTiles(64, 16, 16, group_m=4, num_stages=1, down_block_n=32)  # another alignment, several K steps
    out["blocks"]["gpt_oss/many_tokens/f32/wide"] = _block_case("gpt_oss", "many_tokens", 40, torch.float32, wide)
    out["blocks"]["qwen3_moe/many_tokens/f32/wide"] = _block_case("qwen3_moe", "many_tokens", 40, torch.float32,
                                                                  wide)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, f"triton interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(ALIGN_CASES)), ids=["-".join(map(str, c)) for c in ALIGN_CASES])
def test_alignment_puts_every_pair_once_in_its_experts_blocks(results, index):
    got = results["align"][index]
    assert got["num_m_blocks"] == got["worst_case"]
    assert got["padded"] == got["expected_padded"] <= got["num_m_blocks"] * ALIGN_CASES[index][3]
    for key in ("each_pair_once", "padding_is_sentinel", "pairs_in_their_expert_block",
                "segment_order_is_pair_order", "owners_ascending"):
        assert got[key], key


def test_a_decode_plan_takes_the_routing_as_it_stands(results):
    assert results["direct_plan"] == {"sorted": False, "padded": False, "blocks": 6, "experts": [5, 1, 7, 1, 2, 5]}


def test_fused_experts_match_transformers_and_the_reference(results):
    blocks = results["blocks"]
    assert len(blocks) == 2 * 7 + 2 * len(OTHER_CASES) + 2 * len(BF16_CASES) + 2 + 4
    for name, got in blocks.items():
        tol = 2e-2 if "bf16" in name else 1e-6
        assert got["finite"] and got["dtype_kept"], name
        assert got["vs_reference"] < tol, (name, got)
        assert got["block_vs_transformers"] < tol, (name, got)


@pytest.mark.parametrize("index", range(len(FP8_CASES) + 1), ids=[f"{f}-{b}" for f, b in FP8_CASES] + ["single"])
def test_fused_fp8_experts_match_the_reference_on_their_dequantised_weights(results, index):
    got = results["fp8"][index]
    assert got["fp8"] and got["finite"]
    assert got["vs_reference"] < 1e-5, got
    assert 1e-4 < got["fp8_error"] < 0.1, got  # the weights were rounded to e4m3, and only that


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_whole_moe_model_on_the_fused_path_matches_its_torch_path(results, preset):
    got = results["models"][preset]
    assert got["finite"] and got["rel"] < 1e-5, got


def test_warm_up_token_counts_meet_every_tile_class_once():
    from metronome.kernels.triton_moe import choose_tiles, representative_token_counts

    for top_k, experts in ((8, 128), (4, 32), (2, 8), (4, 60), (1, 4)):
        counts = representative_token_counts(top_k, experts)
        classes = [choose_tiles(t, top_k, experts, True) for t in counts]
        assert len(set(classes)) == len(classes)  # no class twice
        every = {choose_tiles(t, top_k, experts, True) for t in range(1, 200 * experts // top_k)}
        assert set(classes) == every  # and none missing
        for tokens, tiles in zip(counts, classes):  # each the smallest of its class
            assert tokens == 1 or choose_tiles(tokens - 1, top_k, experts, True) != tiles


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(_run_all()))

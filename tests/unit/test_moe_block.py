"""Our MoE block (router, stacked experts, shared expert) against transformers' own blocks of each family, on the
torch paths: the reference loop (the oracle) and the grouped-matmul path.

transformers' blocks are built from its config classes (tiny sizes) and our block loads their weights by name. The
routing cases (moe_cases.py) include the hidden ones: ties in the router (the tie order is torch.topk's on both
sides), every token on the same experts, fewer (token, expert) pairs than experts, one token. The grouped path
sums a token's k expert outputs in float32 and rounds once, where transformers rounds after each expert (in
ascending expert order), so in bf16 it is within a step of the reference, not equal. Also here: loading
every checkpoint layout (per-expert tensors, Mixtral's w1/w2/w3, gpt-oss's transposed/interleaved stacks and MXFP4
pairs), the MXFP4 dequantiser against transformers', sigmoid routing against DeepSeek-V3's router, and bad input.
"""
from __future__ import annotations

import pytest
import torch

from metronome.server.models.moe import SparseMoeBlock, checkpoint_form, resolve_moe_backend
from metronome.server.models.moe_config import (
    MoeSpec,
    expected_distinct_experts,
    moe_layer_indices,
    moe_spec_from_hf,
)
from metronome.server.models.moe_experts import grouped_mm_available
from metronome.server.models.moe_routing import route
from metronome.server.models.mxfp4 import dequantize_mxfp4
from metronome_testing.moe_cases import CASES, FAMILIES, HIDDEN, build_case, hf_block, our_block, rig_router

BACKENDS = ["reference"] + (["grouped_mm"] if grouped_mm_available() else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case,tokens", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_matches_transformers(family, case, tokens, dtype):
    hf, ours, x, expected = build_case(family, case, tokens, dtype)
    with torch.no_grad():
        weights, ids = ours.gate(x)
        if case == "tied_logits":
            logits = torch.nn.functional.linear(x, ours.gate.weight, ours.gate.bias)
            assert torch.equal(logits[:, 1], logits[:, 6]), "the rigged router must tie experts 1 and 6"
        if case == "same_experts":
            assert (ids[:, 0] == 5).all() and (ids[:, 1] == 2).all()
        for backend in BACKENDS:
            got = ours.run(x, backend)
            assert got.dtype == dtype and got.shape == expected.shape
            if dtype == torch.float32:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=backend)
            else:
                torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2, msg=backend)
            if backend == "reference" and dtype == torch.bfloat16:
                # transformers' ops in its order: equal but for a rare step where a matmul's blocking differs
                assert (got != expected).float().mean() < 0.01


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_qwen_routing_without_renormalisation(family):
    hf, config = hf_block(family, norm_topk_prob=False)
    ours = our_block(hf, config, torch.float32)
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        weights, _ = ours.gate(x)
        assert (weights.sum(-1) < 1 - 1e-3).all()  # the top-k probabilities, not renormalised
        torch.testing.assert_close(ours.run(x, "reference"), hf(x[None])[0], rtol=1e-5, atol=1e-5)


def test_router_matches_transformers_routers_on_ties():
    """The chosen experts and weights equal transformers' router outputs exactly when all logits tie."""
    for family in FAMILIES:
        hf, config = hf_block(family)
        rig_router(hf, family, "all_logits_equal")
        ours = our_block(hf, config, torch.float32)
        router = hf.router if family == "gpt_oss" else hf.gate
        x = torch.randn(4, HIDDEN)
        with torch.no_grad():
            _, hf_weights, hf_ids = router(x)
            weights, ids = ours.gate(x)
        assert torch.equal(ids, hf_ids), family
        assert torch.equal(weights, hf_weights), family


def test_sigmoid_grouped_routing_matches_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                              topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    theirs = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=generator))
        theirs.e_score_correction_bias.copy_(torch.randn(16, generator=generator) * 0.5)
    spec = MoeSpec(num_experts=16, top_k=4, intermediate_size=8, scoring="sigmoid", renormalize=True,
                   router_in_float32=True, score_correction_bias=True, num_groups=4, topk_groups=2,
                   routed_scaling_factor=2.5)
    ours = SparseMoeBlock(HIDDEN, spec)
    ours.load_tensor("gate.weight", theirs.weight)
    ours.load_tensor("gate.e_score_correction_bias", theirs.e_score_correction_bias)
    x = torch.randn(9, HIDDEN, generator=generator)
    with torch.no_grad():
        _, hf_weights, hf_ids = theirs(x)
        weights, ids = ours.gate(x)
    # sorted=False: the order of the k picks is free; the set and each expert's weight are not.
    hf_order, order = hf_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-6, atol=1e-6)
    groups = ids // 4  # experts come from at most topk_groups groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_route_softmax_then_topk_keeps_float32_weights_for_mixtral():
    spec = moe_spec_from_hf({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                             "intermediate_size": 8})
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]], dtype=torch.bfloat16)
    weights, ids = route(logits, spec)
    assert weights.dtype == torch.float32 and ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))


# ---- loading ------------------------------------------------------------------------------------------------


def _per_expert_names(state: dict, family: str) -> dict:
    """transformers 5's stacked experts split back into the per-expert tensors the Hub files hold."""
    names = {"mixtral": ("w1", "w3", "w2")}.get(family, ("gate_proj", "up_proj", "down_proj"))
    out = {k: v for k, v in state.items() if not k.startswith("experts.")}
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        out[f"experts.{e}.{names[0]}.weight"] = gate_up[e, :inter]
        out[f"experts.{e}.{names[1]}.weight"] = gate_up[e, inter:]
        out[f"experts.{e}.{names[2]}.weight"] = down[e]
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_per_expert_checkpoint_tensors_stack_like_the_fused_ones(family):
    hf, config = hf_block(family)
    stacked = our_block(hf, config, torch.float32)
    split = SparseMoeBlock(HIDDEN, moe_spec_from_hf(config))
    state = hf.state_dict()
    if family == "qwen2_moe":  # the Hub's shared expert is three tensors too (transformers' module has them so)
        assert "shared_expert.gate_proj.weight" in state
    filled = set()
    for name, tensor in _per_expert_names(state, family).items():
        filled.update(split.load_tensor(name, tensor))
    assert filled == split.expected_shards()
    for (name, a), (_, b) in zip(stacked.state_dict().items(), split.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_experts_go_back_to_the_family_s_checkpoint_layout(family):
    """checkpoint_form undoes what loading does to transformers' own stacked tensors (gpt-oss's transposed and
    interleaved), so weights made in our layout (random ones) can go through the loader."""
    hf, config = hf_block(family)
    ours = our_block(hf, config, torch.float32)
    state = hf.state_dict()
    stacked = [name for name, _ in ours.named_parameters() if name.startswith("experts.") and name in state]
    assert "experts.gate_up_proj" in stacked and "experts.down_proj" in stacked
    for name in stacked:
        assert torch.equal(checkpoint_form(name, ours.get_parameter(name).detach(), ours.spec), state[name]), name


def _mxfp4_pair(rows_shape: tuple[int, ...], columns: int, generator: torch.Generator):
    """Random packed codes (every byte value) and exponents 2^-11 .. 2^0."""
    blocks = torch.randint(0, 256, (*rows_shape, columns // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(116, 128, (*rows_shape, columns // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_mxfp4_dequantisation_is_transformers_bit_for_bit(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(2)
    blocks, scales = _mxfp4_pair((3, 10), 64, generator)
    scales[0, 0, 0], scales[0, 1, 1], scales[2, 3, 0] = 0, 254, 127  # exponent extremes
    blocks[1, 2, 0] = torch.arange(16, dtype=torch.uint8)  # every code in both nibbles
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert ours.dtype == dtype and ours.shape == (3, 10, 64)
    assert torch.equal(ours, theirs)


def test_gpt_oss_mxfp4_experts_load_as_their_dequantised_weights():
    """Blocks + scales (either order, either projection first) load to the same block as transformers'
    dequantised [E, H, 2I] / [E, I, H] tensors; its output equals the transformers block holding those."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf, config = hf_block("gpt_oss")
    experts, inter = 8, 32  # MXFP4 packs rows of 32
    generator = torch.Generator().manual_seed(3)
    packed = {"gate_up_proj": _mxfp4_pair((experts, 2 * inter), HIDDEN, generator),
              "down_proj": _mxfp4_pair((experts, HIDDEN), inter, generator)}
    with torch.no_grad():
        for proj, (blocks, scales) in packed.items():
            getattr(hf.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    block = SparseMoeBlock(HIDDEN, moe_spec_from_hf(config))
    filled = set()
    names = [("experts.down_proj_scales", packed["down_proj"][1]), ("experts.gate_up_proj_blocks",
             packed["gate_up_proj"][0]), ("experts.down_proj_blocks", packed["down_proj"][0]),
             ("experts.gate_up_proj_scales", packed["gate_up_proj"][1])]
    for name, tensor in hf.state_dict().items():
        if not name.endswith(("gate_up_proj", "down_proj")):
            filled.update(block.load_tensor(name, tensor))
    for name, tensor in names:
        filled.update(block.load_tensor(name, tensor))
    assert block.pending() == [] and filled == block.expected_shards()
    reference = our_block(hf, config, torch.float32)
    for (name, a), (_, b) in zip(reference.state_dict().items(), block.state_dict().items()):
        assert torch.equal(a, b), name
    x = torch.randn(6, HIDDEN, generator=generator)
    # The weights above are equal bit for bit; the outputs differ only by fp32 summation order over MXFP4's wide
    # range of magnitudes, which reaches ~1e-5 on a few elements.
    with torch.no_grad():
        torch.testing.assert_close(block.run(x, "reference"), hf(x[None])[0][0], rtol=1e-4, atol=1e-4)


def test_bad_checkpoint_tensors_are_named():
    _, config = hf_block("qwen3_moe")
    block = SparseMoeBlock(HIDDEN, moe_spec_from_hf(config))
    with pytest.raises(ValueError, match="experts.0.up_proj.weight.*shape"):
        block.load_tensor("experts.0.up_proj.weight", torch.zeros(3, 3))
    with pytest.raises(ValueError, match="expert 8 of 8"):
        block.load_tensor("experts.8.up_proj.weight", torch.zeros(16, HIDDEN))
    with pytest.raises(ValueError, match="no place"):
        block.load_tensor("experts.gate_up_proj_bias", torch.zeros(8, 32))
    with pytest.raises(ValueError, match="no place"):
        block.load_tensor("shared_expert.gate_proj.weight", torch.zeros(24, HIDDEN))
    _, config = hf_block("gpt_oss")
    block = SparseMoeBlock(HIDDEN, moe_spec_from_hf(config))
    blocks = torch.zeros(8, HIDDEN, 16 // 32 + 1, 16, dtype=torch.uint8)
    block.load_tensor("experts.down_proj_blocks", blocks)
    assert block.pending() == ["down_proj_blocks"]
    with pytest.raises(ValueError, match="appears twice"):
        block.load_tensor("experts.down_proj_blocks", blocks)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), torch.zeros(8, HIDDEN, 1), torch.float32)
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(blocks, torch.zeros(8, HIDDEN, 2, dtype=torch.uint8), torch.float32)


# ---- config -------------------------------------------------------------------------------------------------


def test_specs_and_sparse_layers_from_transformers_configs():
    from transformers import GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    qwen3 = moe_spec_from_hf(Qwen3MoeConfig(norm_topk_prob=True).to_dict())
    assert (qwen3.num_experts, qwen3.top_k, qwen3.intermediate_size, qwen3.renormalize) == (128, 8, 768, True)
    assert qwen3.weights_in_model_dtype and not qwen3.has_shared_expert
    mixtral = moe_spec_from_hf(MixtralConfig().to_dict())
    assert (mixtral.num_experts, mixtral.top_k, mixtral.intermediate_size) == (8, 2, 14336)
    assert mixtral.renormalize and not mixtral.weights_in_model_dtype
    oss = moe_spec_from_hf(GptOssConfig().to_dict())
    assert (oss.num_experts, oss.top_k, oss.activation, oss.swiglu_limit) == (128, 4, "swiglu_clamped", 7.0)
    assert oss.topk_before_softmax and oss.router_bias and oss.expert_bias
    qwen2 = moe_spec_from_hf(Qwen2MoeConfig().to_dict())
    assert qwen2.shared_expert_intermediate_size == 5632 and qwen2.shared_expert_gate
    raw = Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]).to_dict()
    assert moe_layer_indices(raw, 6) == (1, 5)
    assert moe_layer_indices(MixtralConfig().to_dict(), 3) == (0, 1, 2)
    # the parameter count is the block's own
    block = SparseMoeBlock(HIDDEN, moe_spec_from_hf(hf_block("gpt_oss")[1]))
    assert qwen2.block_parameters(2048) > 0
    assert block.spec.block_parameters(HIDDEN) == sum(p.numel() for p in block.parameters())


def test_bad_specs_and_backends_say_what_is_wrong():
    from metronome.server.models.config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="top_k"):
        MoeSpec(num_experts=4, top_k=5, intermediate_size=8)
    with pytest.raises(UnsupportedModelError, match="activation"):
        MoeSpec(num_experts=4, top_k=2, intermediate_size=8, activation="gelu")
    with pytest.raises(UnsupportedModelError, match="groups"):
        MoeSpec(num_experts=6, top_k=2, intermediate_size=8, num_groups=4)
    with pytest.raises(UnsupportedModelError, match="no MoE block"):
        moe_spec_from_hf({"model_type": "llama", "num_local_experts": 4, "num_experts_per_tok": 2})
    assert resolve_moe_backend("auto", torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="unknown MoE backend"):
        resolve_moe_backend("cutlass", torch.device("cpu"))


def test_expected_distinct_experts_is_what_uniform_routing_reads():
    assert expected_distinct_experts(128, 8, 0) == 0.0
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8.0)
    assert expected_distinct_experts(8, 2, 10_000) == pytest.approx(8.0)
    generator = torch.Generator().manual_seed(0)
    for experts, top_k, tokens in ((128, 8, 64), (32, 4, 16), (8, 2, 3)):
        draws = [torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1).indices.unique().numel()
                 for _ in range(400)]
        simulated = sum(draws) / len(draws)
        assert simulated == pytest.approx(expected_distinct_experts(experts, top_k, tokens), rel=0.02)

"""Tiny MoE blocks of each family built by transformers from its own config classes, our block loaded from their
weights, and the routing cases the MoE tests run: plain batches, one token, fewer pairs than experts, every token
on the same experts, and ties in the router logits.

Used by tests/unit/test_moe_block.py (torch paths), tests/unit/test_moe_triton.py (the Triton kernels, in a
subprocess under Triton's interpreter) and tests/gpu/test_moe_gpu.py, so all compare against the same
transformers outputs. The blocks are built on the CPU; `build_case(..., device=)` moves them.
"""
from __future__ import annotations

import torch

HIDDEN = 32
FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe")
# (name, tokens); the router of the rigged cases is changed by `rig_router`.
CASES = [("random", 7), ("single_token", 1), ("fewer_pairs_than_experts", 3), ("same_experts", 9),
         ("tied_logits", 6), ("all_logits_equal", 5), ("many_tokens", 40)]


def hf_block(family: str, norm_topk_prob: bool = True):
    """(transformers block, its config dict): 8 experts, top-2 (Qwen3: top-3), random weights of std 0.3 so that
    routing and activations are far from uniform."""
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                                norm_topk_prob=norm_topk_prob)
    elif family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
    elif family == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block

        config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block

        config = Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    else:
        raise ValueError(family)
    block = Block(config)
    generator = torch.Generator().manual_seed(sum(map(ord, family)))
    with torch.no_grad():
        for _, param in sorted(block.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return block.eval(), config.to_dict()


def router_weight_names(family: str) -> tuple[str, str | None]:
    return ("router.weight", "router.bias") if family == "gpt_oss" else ("gate.weight", None)


def rig_router(block, family: str, case: str) -> None:
    """Make the router produce the case's routing (for any input with positive entries, see `case_input`)."""
    weight_name, bias_name = router_weight_names(family)
    params = dict(block.named_parameters())
    weight = params[weight_name]
    bias = params[bias_name] if bias_name else None
    with torch.no_grad():
        if case == "same_experts":  # experts 5 then 2 win for every token
            weight[5].fill_(2.0)
            weight[2].fill_(1.5)
        elif case == "tied_logits":  # expert 3 first; experts 1 and 6 tie for the next places
            weight[3].fill_(2.0)
            weight[6].copy_(weight[1])
            weight[1].add_(1.0)
            weight[6].add_(1.0)
            if bias is not None:
                bias[6] = bias[1]
        elif case == "all_logits_equal":  # every expert ties: the pick is torch.topk's tie order alone
            weight.zero_()
            if bias is not None:
                bias.zero_()


def case_input(case: str, tokens: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(tokens * 7 + len(case))
    x = torch.randn(tokens, HIDDEN, generator=generator)
    if case in ("same_experts", "tied_logits"):
        x = x.abs() + 0.5
    return x.to(device, dtype)


def hf_output(block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def our_block(hf, config: dict, dtype: torch.dtype):
    """Our SparseMoeBlock with transformers' weights, loaded through load_tensor by their names."""
    from metronome.server.models.moe import SparseMoeBlock
    from metronome.server.models.moe_config import moe_spec_from_hf

    block = SparseMoeBlock(HIDDEN, moe_spec_from_hf(config)).to(dtype)
    filled = set()
    for name, tensor in hf.state_dict().items():
        filled.update(block.load_tensor(name, tensor))
    assert filled == block.expected_shards()
    return block.eval()


def build_case(family: str, case: str, tokens: int, dtype: torch.dtype, device: str = "cpu"):
    """(transformers block, our block, input, transformers' output) for one case."""
    hf, config = hf_block(family)
    rig_router(hf, family, case)
    hf = hf.to(device, dtype)
    x = case_input(case, tokens, dtype, device)
    return hf, our_block(hf, config, dtype).to(device), x, hf_output(hf, x)

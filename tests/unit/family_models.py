"""Tiny random models of each family, built with transformers' own config classes and saved as Hugging Face
folders (safetensors + a byte-level tokenizer), for the exactness tests. Small windows (16-24 tokens) so that
prompts cross them; norms and biases randomised so that a mix-up of weights would show."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
WINDOW = 20


def _base(**extra):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2, **extra)


def qwen3_config():
    from transformers import Qwen3Config

    # Sliding layers from layer 1 on: the window and the full layer both matter.
    return Qwen3Config(**_base(head_dim=16, rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=True,
                               sliding_window=WINDOW, max_window_layers=1))


def gemma3_config(softcap: bool = False):
    from transformers import Gemma3TextConfig

    caps = dict(final_logit_softcapping=15.0) if softcap else {}
    return Gemma3TextConfig(**_base(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_local_base_freq=500.0,
        rope_theta=20000.0, **caps))


def phi3_config():
    from transformers import Phi3Config

    half = 6  # rotary dims 12 of head_dim 16 (partial_rotary_factor 0.75)
    return Phi3Config(**_base(
        sliding_window=WINDOW + 4, tie_word_embeddings=False, pad_token_id=0, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.1 * i for i in range(half)],
                         "long_factor": [2.0 + 0.5 * i for i in range(half)],
                         "original_max_position_embeddings": 64}))


def mistral_config():
    from transformers import MistralConfig

    # Every layer slides: the KV cache holds a window per sequence whatever its length.
    return MistralConfig(**_base(head_dim=16, sliding_window=WINDOW, rope_theta=10000.0, tie_word_embeddings=False))


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    # Layer 1 keeps a dense MLP (mlp_only_layers); the others route to 2 of 8 experts, renormalised.
    return Qwen3MoeConfig(**_base(head_dim=16, rope_theta=10000.0, tie_word_embeddings=False),
                          moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                          mlp_only_layers=[1])


def qwen2_moe_config():
    from transformers import Qwen2MoeConfig

    # Only layer 1 is sparse (decoder_sparse_step 2), with a gated shared expert; top-3 not renormalised.
    return Qwen2MoeConfig(**_base(rope_theta=10000.0, tie_word_embeddings=False), moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
                          decoder_sparse_step=2)


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(**_base(head_dim=16, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=WINDOW),
                         num_local_experts=4, num_experts_per_tok=2)


def gpt_oss_config():
    from transformers import GptOssConfig

    # Window and full layers alternating, YaRN, sinks, biases; 4 experts of 96 (MXFP4 rows are 32 wide).
    return GptOssConfig(**_base(head_dim=16, tie_word_embeddings=False, sliding_window=WINDOW),
                        num_local_experts=4, num_experts_per_tok=2,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


FAMILIES = {"qwen3": qwen3_config, "mistral": mistral_config, "gemma3": gemma3_config,
            "gemma3-softcap": lambda: gemma3_config(softcap=True), "phi3": phi3_config,
            "qwen3_moe": qwen3_moe_config, "qwen2_moe": qwen2_moe_config, "mixtral": mixtral_config,
            "gpt_oss": gpt_oss_config}
# Routers are scaled up so that experts win by clear margins: a near tie in routing would flip on float noise.
ROUTER_WEIGHTS = ("mlp.gate.weight", "mlp.router.weight")


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer without merges (one token per byte) plus specials, saved in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *sorted(alphabet)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.save_pretrained(folder)


def save_hf_model(folder: Path, config, seed: int = 0) -> torch.nn.Module:
    """A random transformers model of `config`, saved (safetensors, float32) with a tokenizer; returned in eval."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    with torch.no_grad():  # norms and biases start at 1/0: randomise them so a mix-up would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias") or name.endswith(".sinks"):
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith(ROUTER_WEIGHTS):
                param.mul_(10.0)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model

"""Which model class serves which architecture (ModelConfig.architecture)."""
from __future__ import annotations

from metronome.server.models.config import ModelConfig, UnsupportedModelError
from metronome.server.models.decoder import DecoderForCausalLM


def model_class(config: ModelConfig) -> type[DecoderForCausalLM]:
    from metronome.server.models.gemma3 import Gemma3ForCausalLM
    from metronome.server.models.gpt_oss import GptOssForCausalLM
    from metronome.server.models.llama import LlamaForCausalLM
    from metronome.server.models.mixtral import MixtralForCausalLM
    from metronome.server.models.phi3 import Phi3ForCausalLM
    from metronome.server.models.qwen2_moe import Qwen2MoeForCausalLM
    from metronome.server.models.qwen3 import Qwen3ForCausalLM
    from metronome.server.models.qwen3_moe import Qwen3MoeForCausalLM

    classes = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
               "qwen3": Qwen3ForCausalLM, "gemma3": Gemma3ForCausalLM, "phi3": Phi3ForCausalLM,
               "qwen3_moe": Qwen3MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM, "mixtral": MixtralForCausalLM,
               "gpt_oss": GptOssForCausalLM}
    found = classes.get(config.architecture)
    if found is None:
        raise UnsupportedModelError(f"no model class for architecture {config.architecture!r}")
    return found


def build_model(config: ModelConfig, attention, parts=None) -> DecoderForCausalLM:
    return model_class(config)(config, attention, parts)

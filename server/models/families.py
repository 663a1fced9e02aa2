"""Which model class serves which architecture (ModelConfig.architecture)."""
from __future__ import annotations

from metronome.server.models.config import ModelConfig, UnsupportedModelError
from metronome.server.models.decoder import DecoderForCausalLM


def model_class(config: ModelConfig) -> type[DecoderForCausalLM]:
    from metronome.server.models.gemma3 import Gemma3ForCausalLM
    from metronome.server.models.llama import LlamaForCausalLM
    from metronome.server.models.phi3 import Phi3ForCausalLM
    from metronome.server.models.qwen3 import Qwen3ForCausalLM

    classes = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
               "qwen3": Qwen3ForCausalLM, "gemma3": Gemma3ForCausalLM, "phi3": Phi3ForCausalLM}
    found = classes.get(config.architecture)
    if found is None:
        raise UnsupportedModelError(f"no model class for architecture {config.architecture!r}")
    return found


def build_model(config: ModelConfig, attention, parts=None) -> DecoderForCausalLM:
    return model_class(config)(config, attention, parts)

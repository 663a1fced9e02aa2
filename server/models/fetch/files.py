"""Which files of a remote model to download, and how the downloaded folder is loaded. Pure functions."""
from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

from metronome.contract.errors import ModelNotFoundError

# What the Hugging Face folder loader reads (hf_loader.py, tokenizer.py); nothing else is downloaded, so a repo
# that also carries PyTorch .bin files, ONNX exports or `original/` checkpoints costs only what is used.
HF_FOLDER_PATTERNS = (
    "config.json", "generation_config.json", "hf_quant_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)


def select_model_files(names: list[str], uri: str, filename: str | None = None) -> list[str]:
    """The files to fetch out of a listing of the source: one named file; else a Hugging Face folder
    (config.json + *.safetensors at the top level); else the single top-level .gguf. ModelNotFoundError
    otherwise, naming what was found."""
    if filename is not None:
        if filename not in names:
            raise ModelNotFoundError(f"{uri}: the repo has no file {filename!r}")
        return [filename]
    top = [n for n in names if "/" not in n]
    if "config.json" in top and any(n.endswith(".safetensors") for n in top):
        return sorted(n for n in top if any(fnmatch(n, p) for p in HF_FOLDER_PATTERNS))
    ggufs = sorted(n for n in top if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        raise ModelNotFoundError(f"{uri} holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); name one: "
                                 f"hf://org/name/<file>.gguf or s3://bucket/prefix/<file>.gguf")
    shown = ", ".join(sorted(top)[:10]) or "nothing"
    raise ModelNotFoundError(f"{uri} is not a model: expected config.json with *.safetensors, or one .gguf file, "
                             f"at its top level; found {shown}")


def local_model_spec(folder: Path) -> str:
    """The local spec (`hf-dir:` or `gguf:`) that loads a downloaded folder."""
    if (folder / "config.json").is_file():
        return f"hf-dir:{folder}"
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return f"gguf:{ggufs[0]}"
    raise ModelNotFoundError(f"{folder} holds neither config.json nor exactly one .gguf file")

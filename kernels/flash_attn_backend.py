"""The `flash_attn` backend: FlashAttention-4 (`flash_attn.cute`, written in the CuTe DSL) over the paged cache, on
Hopper (compute capability 9.0) and newer.

FA4 installs as `flash-attn-4` (`pip install 'metronome[flash]'`) and compiles its kernels at run time (no nvcc:
the CuTe DSL ships its own compiler), ~8 s per kernel variant, kept on disk when its JIT cache is on: this module
turns it on in a writable folder before flash_attn.cute is first imported (the package reads both settings at
import), so a read-only image works. Its package is `flash_attn.cute`; `flash_attn` itself is then a namespace
package, so `import flash_attn` succeeding says nothing about which API is there: only `flash_attn.cute` with its
`flash_attn_varlen_func` counts.

The call: q [T, H, D] with cu_seqlens_q; the cache's K/V as pages `(num_blocks, block_size, n_kv, D)` with the
block table as `page_table` (int32 [B, pages]) and each sequence's context length as `seqused_k`; GQA from the
head counts; causal, bottom-right aligned; a sliding window of w keys as window_size (w - 1, 0); softcap and
learned sinks (`learnable_sink`, natural-log units, as the torch reference has them) passed through;
max_seqlen_q/k as Python ints (host values: tensors would enter its compile key). K/V writes are Triton's.
Decode launches are not captured in CUDA graphs (its launches depend on host values per call); the pieces around
its attentions are (`graph_capture = "pieces"`).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

from .checks import check_attention_inputs, check_write_kv_inputs
from .metadata import AttentionMetadata

FA4_MODULE = "flash_attn.cute"
MIN_CAPABILITY = (9, 0)  # FA4's forward kernels: sm90 (Hopper), sm100/sm103 (Blackwell), sm120
FA4_DTYPES = (torch.bfloat16, torch.float16)
CACHE_ENABLED_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
CACHE_DIR_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
INSTALL_HINT = "pip install 'metronome[flash]' (flash-attn-4 and the CuTe DSL)"
# Above this batch size FA4's varlen scheduler takes another kernel variant (a batch lookup aid).
FA4_LARGE_BATCH = 256


def configure_jit_cache(directory: str | os.PathLike | None = None) -> Path:
    """Keep FA4's compiled kernels on disk in `directory` (default: $FLASH_ATTENTION_CUTE_DSL_CACHE_DIR if set,
    else $TMPDIR/metronome-flash-attn-cute). Settings already in the environment win; flash_attn.cute reads them
    when it is first imported, so this must run before that (fa4_importable and the backend call it)."""
    os.environ.setdefault(CACHE_ENABLED_ENV, "1")
    if directory is not None:
        os.environ.setdefault(CACHE_DIR_ENV, str(directory))
    path = Path(os.environ.get(CACHE_DIR_ENV) or Path(tempfile.gettempdir()) / "metronome-flash-attn-cute")
    os.environ[CACHE_DIR_ENV] = str(path)
    return path


@cache
def fa4_importable() -> bool:
    """flash_attn.cute imports and has FA4's varlen entry point (a namespace `flash_attn`, FA2, or an install
    whose CUDA libraries fail to load all count as absent)."""
    try:
        if importlib.util.find_spec(FA4_MODULE) is None:
            return False
    except (ImportError, ValueError):  # no flash_attn at all, or a broken one
        return False
    configure_jit_cache()
    try:
        module = importlib.import_module(FA4_MODULE)
    except Exception:  # noqa: BLE001 - any load failure means "not available"
        return False
    return callable(getattr(module, "flash_attn_varlen_func", None))


def fa4_runs_on(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def flash_attn_fits(head_dim: int) -> bool:
    """FA4's head sizes on Hopper: 8..256, a multiple of 8 (16-byte rows in bf16/fp16). Any page size works."""
    return 8 <= head_dim <= 256 and head_dim % 8 == 0


def fa4_window(window: int | None) -> tuple[int | None, int | None]:
    """A layer's window (a query at p sees keys p - window + 1 .. p) as FA4's (left, right); causal sets right 0."""
    return (None, None) if window is None else (window - 1, 0)


class FlashAttnBackend:
    name = "flash_attn"
    graph_capture = "pieces"

    def __init__(self, module: Any = None) -> None:
        """module: FA4's `flash_attn.cute` (tests inject a stand-in); imported here otherwise."""
        if module is None:
            if not fa4_importable():
                raise ImportError(f"FlashAttention-4 ({FA4_MODULE}) is not installed or does not load: {INSTALL_HINT}")
            module = importlib.import_module(FA4_MODULE)
        self._varlen = module.flash_attn_varlen_func

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        check_write_kv_inputs(key, value, k_cache, v_cache, slot_mapping)
        from .triton_kv_write import write_kv_triton
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor | None = None, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        check_attention_inputs(q, k_cache, v_cache, meta, window, sinks)
        if q.dtype not in FA4_DTYPES or k_cache.dtype != q.dtype:
            raise ValueError(f"flash_attn (FA4) runs bf16 or fp16 with a cache of the same dtype, got q {q.dtype} "
                             f"and cache {k_cache.dtype}; use the triton backend")
        if not flash_attn_fits(q.shape[2]):
            raise ValueError(f"flash_attn (FA4) needs head_dim a multiple of 8 in 8..256, got {q.shape[2]}")
        result = self._varlen(
            q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.seq_lens,
            max_seqlen_q=int(meta.max_seqlen_q), max_seqlen_k=int(meta.max_seqlen_k), page_table=meta.block_tables,
            softmax_scale=scale, causal=True, window_size=fa4_window(window), learnable_sink=sinks,
            softcap=0.0 if softcap is None else float(softcap),
        )
        result = result[0] if isinstance(result, tuple) else result  # (out, lse)
        if out is None:
            return result
        out.copy_(result)
        return out

    # Launch variants for decode graphs: none are captured (graph_capture "pieces").
    def decode_variant(self, num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
        return 0

    def variant_lengths(self, max_model_len: int) -> list[int]:
        return [max_model_len]

    def warm_up(self, q_shape, k_cache, v_cache, max_model_len: int, windows=(None,), softcap=None,
                sinks=False, batches: tuple[tuple[int, ...], ...] | None = None,
                dtype: torch.dtype | None = None) -> int:
        """Compile FA4's variants for these shapes and every layer window, softcap and sinks: a batch of short
        rows (one query tile: decodes) and one of longer rows, each at up to and above FA4_LARGE_BATCH sequences
        (its compile key changes with these), or the given `batches` (q_lens each); q in `dtype` (default: the
        cache's). Returns the launches made."""
        from .triton_kv_write import write_kv_triton  # its K/V writes are Triton's

        device = k_cache.device
        slots = torch.full((1,), -1, dtype=torch.int64, device=device)
        kv = torch.zeros((1, *k_cache.shape[2:]), dtype=k_cache.dtype, device=device)
        write_kv_triton(kv, kv, k_cache, v_cache, slots)
        launches = 1
        _, n_heads, head_dim = q_shape
        sink_logits = torch.zeros(n_heads, dtype=torch.float32, device=device) if sinks else None
        batches = batches or warm_up_batches(n_heads // k_cache.shape[2])
        scratch = k_cache.shape[0] - 1
        for window in dict.fromkeys(windows):
            for q_lens in batches:
                meta = _scratch_pages(list(q_lens), scratch, k_cache.shape[1], device)
                q = torch.zeros((sum(q_lens), n_heads, head_dim), dtype=dtype or k_cache.dtype, device=device)
                self.attention(q, k_cache, v_cache, meta, 1.0, window=window, softcap=softcap, sinks=sink_logits)
                launches += 1
        return launches


def warm_up_batches(group: int) -> tuple[tuple[int, ...], ...]:
    """Batches (q_lens) that meet FA4's launch variants: rows of one query tile (decodes; a tile holds 128 query
    rows of a packed GQA group) and of several, at up to and above FA4_LARGE_BATCH sequences."""
    long = -(-129 // max(group, 1))  # more query rows than one tile
    few, many = 2, FA4_LARGE_BATCH + 1
    return ((1,) * few, (1,) * many, (1, long), (1,) * (many - 1) + (long,))


def _scratch_pages(q_lens: list[int], block: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """Sequences with no cached context reading the scratch block for every page they span (never written)."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    pages = max(-(-n // block_size) for n in q_lens)
    ints = torch.tensor(cu + q_lens + [block] * (len(q_lens) * pages), dtype=torch.int32, device=device)
    b = len(q_lens)
    return AttentionMetadata(cu_seqlens_q=ints[:b + 1], seq_lens=ints[b + 1:2 * b + 1],
                             block_tables=ints[2 * b + 1:].view(b, pages),
                             slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64, device=device),
                             max_seqlen_q=max(q_lens), max_seqlen_k=max(q_lens), q_lens_host=list(q_lens),
                             seq_lens_host=list(q_lens))

"""`--attention-backend auto` on CUDA: which backend runs each batch class, from one measured table.

A batch's class comes from its shape alone: decode-only batches by their sequence count, batches without a decode
by their token count, and batches with both are `mixed`. Each class names the representative batch the A/B
measures (hack/bench_attention.py: the same metadata through both backends, device time and host time per call).
The table (attention_table.json beside this file) records which backend won each class, with the date, machine
and command of the measurement; a class it does not name, and any class on a machine without FA4, runs Triton.

`PerClassBackend` is the backend `auto` resolves to when the table sends any class to flash_attn and FA4 runs
here: it routes each attention call by class. A launch being captured into a CUDA graph (the decode graphs) is
always Triton's: FA4's launches read host values per call. K/V writes are Triton's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .metadata import AttentionMetadata

TABLE_PATH = Path(__file__).with_name("attention_table.json")
CHOICES = ("triton", "flash_attn")


@dataclass(frozen=True)
class BatchClass:
    name: str
    kind: str  # "decode" (every sequence one token), "chunk" (no decode) or "mixed"
    up_to: int | None  # largest sequence count (decode) or token count (chunk) of the class; None: no bound
    representative: tuple[int, int, int]  # the A/B's batch: (decodes, chunk tokens, context of each)


# Ordered by kind, then size; a batch takes the first class of its kind whose bound holds.
BATCH_CLASSES = (
    BatchClass("decode_small", "decode", 16, (1, 0, 2048)),
    BatchClass("decode_medium", "decode", 128, (64, 0, 2048)),
    BatchClass("decode_large", "decode", None, (256, 0, 2048)),
    BatchClass("chunk_small", "chunk", 256, (0, 128, 1024)),
    BatchClass("chunk_medium", "chunk", 1024, (0, 512, 1024)),
    BatchClass("chunk_large", "chunk", None, (0, 2048, 1024)),
    BatchClass("mixed", "mixed", None, (64, 512, 2048)),
)
CLASS_NAMES = tuple(c.name for c in BATCH_CLASSES)


def classify(num_seqs: int, num_tokens: int, any_decode: bool) -> str:
    """The class of a batch of num_seqs sequences bringing num_tokens new tokens. Pure."""
    if num_tokens == num_seqs:
        kind, size = "decode", num_seqs
    elif any_decode:
        kind, size = "mixed", num_tokens
    else:
        kind, size = "chunk", num_tokens
    for batch_class in BATCH_CLASSES:
        if batch_class.kind == kind and (batch_class.up_to is None or size <= batch_class.up_to):
            return batch_class.name
    raise AssertionError("every kind has an unbounded class")


@dataclass(frozen=True)
class ChoiceTable:
    choice: dict[str, str]
    measured: dict[str, Any] | None = None  # date, machine, command of the A/B behind the choices
    note: str = ""
    results: dict[str, Any] = field(default_factory=dict)  # the A/B's numbers per class, where written

    def backend_for(self, batch_class: str) -> str:
        return self.choice.get(batch_class, "triton")

    @property
    def uses_flash_attn(self) -> bool:
        return "flash_attn" in self.choice.values()

    def to_json(self) -> dict[str, Any]:
        return {"measured": self.measured, "note": self.note, "choice": dict(self.choice), "results": self.results}


def parse_table(raw: dict[str, Any]) -> ChoiceTable:
    """Checked: unknown classes or backends are errors (a typo must not silently route to Triton)."""
    choice = raw.get("choice")
    if not isinstance(choice, dict):
        raise ValueError("an attention table needs a 'choice' object: batch class -> backend")
    unknown = sorted(set(choice) - set(CLASS_NAMES))
    if unknown:
        raise ValueError(f"attention table: unknown batch class(es) {unknown}; classes are {', '.join(CLASS_NAMES)}")
    bad = sorted({v for v in choice.values() if v not in CHOICES})
    if bad:
        raise ValueError(f"attention table: unknown backend(s) {bad}; choose from {', '.join(CHOICES)}")
    measured = raw.get("measured")
    if any(v == "flash_attn" for v in choice.values()) and not measured:
        raise ValueError("attention table: a class sent to flash_attn needs the 'measured' record (date, machine, "
                         "command) it came from")
    return ChoiceTable(dict(choice), measured, str(raw.get("note", "")), dict(raw.get("results") or {}))


def load_table(path: str | Path | None = None) -> ChoiceTable:
    return parse_table(json.loads(Path(path or TABLE_PATH).read_text()))


def choose(results: dict[str, dict[str, float | None]]) -> dict[str, str]:
    """Per class, the backend with the lower time per call; Triton where FA4 has no time (it failed or is absent)
    or ties. results: class -> {"triton": ms, "flash_attn": ms or None}. Pure."""
    picked = {}
    for name in CLASS_NAMES:
        times = results.get(name) or {}
        triton, flash = times.get("triton"), times.get("flash_attn")
        picked[name] = "flash_attn" if flash is not None and triton is not None and flash < triton else "triton"
    return picked


class PerClassBackend:
    """Triton and FA4 behind one backend, chosen per batch class by the table."""

    name = "auto"
    graph_capture = "all"  # captured launches are Triton's

    def __init__(self, table: ChoiceTable, triton: Any, flash: Any):
        self.table = table
        self.triton = triton
        self.flash = flash
        self._memo: list = [None, "triton"]  # (the q_lens list of the step's metadata, its class's backend name)

    def describe(self) -> str:
        routes = ", ".join(f"{c}={self.table.backend_for(c)}" for c in CLASS_NAMES)
        return f"auto per batch class ({routes})"

    def backend_for(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> Any:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return self.triton
        if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype:
            return self.triton  # FA4 on sm90: bf16/fp16 only, no FP8 cache
        q_lens = meta.q_lens_host  # one list per step, shared by every layer's metadata: classify it once
        if self._memo[0] is not q_lens:
            name = classify(len(q_lens), q.shape[0], meta.max_seqlen_q == 1 or 1 in q_lens)
            self._memo[:] = [q_lens, self.table.backend_for(name)]
        return self.flash if self._memo[1] == "flash_attn" else self.triton

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self.triton.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor | None = None, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self.backend_for(q, k_cache, meta).attention(q, k_cache, v_cache, meta, scale, out=out, window=window,
                                                            softcap=softcap, sinks=sinks)

    def decode_variant(self, num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
        return self.triton.decode_variant(num_seqs, num_kv_heads, max_seqlen_k, device)

    def variant_lengths(self, max_model_len: int) -> list[int]:
        return self.triton.variant_lengths(max_model_len)

    def warm_up(self, q_shape, k_cache, v_cache, max_model_len: int, windows=(None,), softcap=None,
                sinks=False) -> int:
        """Triton's variants, and FA4's for the shapes of the classes the table sends to it."""
        launches = self.triton.warm_up(q_shape, k_cache, v_cache, max_model_len, windows=windows, softcap=softcap,
                                       sinks=sinks)
        if self.table.uses_flash_attn and k_cache.dtype in (torch.bfloat16, torch.float16):
            launches += self.flash.warm_up(q_shape, k_cache, v_cache, max_model_len, windows=windows,
                                           softcap=softcap, sinks=sinks)
        return launches

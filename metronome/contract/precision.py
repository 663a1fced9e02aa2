"""The number formats a server can be asked for, written once for both halves: `--quantization` and
`--kv-cache-dtype` of `metronome serve|generate|bench`, and `spec.model.quantization` / `spec.engine.kvCacheDtype`
of an InferenceService (the CRD's enums are held to these by tests/unit/test_crd_schema.py)."""
from __future__ import annotations

# On-the-fly quantisation of the decoder's linear layers; unset = as the checkpoint is (an FP8 checkpoint loads
# as FP8 without it).
QUANTIZATIONS = ("fp8",)
# KV cache element type; auto = the model dtype.
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")

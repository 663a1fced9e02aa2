"""FP8 quantisation: e4m3 weights with their scales, activations quantised per token / per group / with a static
scale, GEMMs through `torch._scaled_mm` or Triton on CUDA and an exact float32 emulation elsewhere.

- fp8.py: the number format and scale conventions (the torch reference every kernel matches);
- scheme.py: which scheme a checkpoint's `quantization_config` (or `--quantization fp8`) asks for (no torch);
- activation.py, fp8_linear.py, cuda_gemm.py: quantised activations, the linear layer, its CUDA GEMMs;
- model_pass.py, loading.py: swapping the decoder's linears and loading checkpoints into them.
"""
from metronome.server.models.quant.scheme import (
    Fp8Scheme,
    QuantizationConfigError,
    resolve_scheme,
    scheme_from_config,
)

__all__ = ["Fp8Scheme", "QuantizationConfigError", "resolve_scheme", "scheme_from_config"]

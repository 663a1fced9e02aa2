"""Attention and KV-write kernels over the paged KV cache: torch (reference), triton, flash_attn backends."""

"""Defaults of the per-request limits that keep one client from disturbing the others (no imports: the CLI
reads them at argument-parsing time)."""

DEFAULT_MAX_BODY_BYTES = 2 << 20  # 2 MiB: a 128k-token prompt needs about 0.5 MiB as text, 1 MiB as token ids
DEFAULT_TOKENIZER_WORKERS = 2

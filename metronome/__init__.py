"""Metronome: smooth LLM token streams on Kubernetes.

Sub-packages: `metronome.server` (engine, models, HTTP API, bench), `metronome.kernels` (attention and KV-write
kernels) and `metronome.operator` (the kopf operator). Importing this package imports nothing heavy.
"""

__version__ = "0.1.0"

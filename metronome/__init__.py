"""Metronome: smooth LLM token streams on Kubernetes.

Sub-packages: `metronome.contract` (what both halves share: config schema, metric names, errors, model-source
syntax), `metronome.server` (engine, models, HTTP API, bench; folder server/), `metronome.kernels` (attention and
KV-write kernels; folder kernels/) and `metronome.operator` (the kopf operator; folder operator/). Importing this
package imports nothing heavy.
"""

# The one version string: pyproject.toml reads it (setuptools dynamic version), the operator's default server
# image is tagged with it, and tests/unit/test_chart_files.py holds the chart, the CRD and the examples to it.
__version__ = "0.1.0"

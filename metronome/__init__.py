"""Metronome: smooth LLM token streams on Kubernetes.

Sub-packages: `metronome.contract` (what both halves share: config schema, metric names, errors, model-source
syntax), `metronome.server` (engine, models, HTTP API, bench; folder server/), `metronome.kernels` (attention and
KV-write kernels; folder kernels/) and `metronome.operator` (the kopf operator; folder operator/). Importing this
package imports nothing heavy.
"""

# The one version string: pyproject.toml reads it (setuptools dynamic version), the operator's default server
# image is tagged with it, and tests/unit/test_chart_files.py holds the chart, the CRD and the examples to it.
__version__ = "0.1.0"

# Run from a source checkout without an install (the GPU machine, a fresh clone), the working directory's
# `metronome/` folder is found first and holds only cli.py and contract/; setup.py maps the sibling folders
# server/, kernels/ and operator/ into the package, and this does the same for the checkout, so scripts and tests
# run from the repository root need no `python -P` or assembled copy. An installed package has no setup.py beside it.
def source_checkout() -> str | None:
    """The checkout this package runs from, or None for an installed package. A child process started with
    `python -m metronome.cli` from this folder imports the same code (cwd joins sys.path after start-up)."""
    from pathlib import Path

    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "setup.py").is_file() and (checkout / "server" / "__init__.py").is_file():
        return str(checkout)
    return None


def _map_checkout_folders() -> None:
    checkout = source_checkout()
    if checkout is not None:
        __path__.append(checkout)  # noqa: F821 (a package's __path__)


_map_checkout_folders()

"""The closed loop on one machine, shared by tests/e2e and hack/demo.py: long-short load against the stand-in's
servers (load.py) and the CPU run's TBT target (slo.py). The operator's side is chart.py and operator_process.py
one folder up.
"""
from .load import LoadDriver, LoadSpec

__all__ = ["LoadDriver", "LoadSpec"]

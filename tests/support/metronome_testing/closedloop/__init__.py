"""The closed loop on one machine, shared by tests/e2e and hack/demo.py: long-short load against the stand-in's
servers (load.py), the same spread over a service's ready servers as they come and go (service_load.py) and the
CPU run's TBT target (slo.py). The operator's side is chart.py and operator_process.py one folder up.
"""
from .load import LoadDriver, LoadSpec
from .service_load import ServiceLoad

__all__ = ["LoadDriver", "LoadSpec", "ServiceLoad"]

"""The closed loop on one machine, shared by tests/e2e and hack/demo.py: the operator as a local process under
the chart's identity, Prometheus scraping the stand-in's servers, and long-short load against them.

Import with hack/ on sys.path (as tests/conftest.py and hack/demo.py arrange): `from closedloop import ...`.
"""
from .chart import install_chart, service_account_kubeconfig
from .load import LoadDriver, LoadSpec
from .operator_process import OperatorProcess, OperatorStartError

__all__ = ["LoadDriver", "LoadSpec", "OperatorProcess", "OperatorStartError", "install_chart",
           "service_account_kubeconfig"]

"""Children that cannot outlive their parent: if the driver (pytest, the demo) is killed before it can stop
what it started, the kernel sends the child SIGTERM (Linux PR_SET_PDEATHSIG). A normal stop still goes by pid."""
from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1
# Looked up once in the parent: between fork and exec the child should only call, never load libraries.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """A `preexec_fn` for subprocess.Popen. The signal fires when the *thread* that started the child ends, so
    start children from a thread that lives as long as they should."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

"""Polling for tests (and the harness) that wait on real processes: the API server, Prometheus, servers."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class WaitTimeout(AssertionError):
    pass


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0, interval: float = 0.5) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` and the last value or error."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - keep polling; the last error is reported on timeout
            last = exc
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")
        time.sleep(interval)

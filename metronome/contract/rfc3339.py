"""Times as the Kubernetes API writes a date-time: RFC 3339, UTC, to the second, with `Z` — the operator's status
and Events, and the `date` of benchmark results."""
from __future__ import annotations

import datetime as dt
from typing import Any


def format_time(epoch_seconds: float | None = None) -> str:
    """`epoch_seconds` (default: now) as e.g. 2026-01-01T00:00:00Z."""
    moment = dt.datetime.now(dt.timezone.utc) if epoch_seconds is None else \
        dt.datetime.fromtimestamp(epoch_seconds, dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: Any) -> float | None:
    """RFC 3339 (as the API stores date-time) → seconds since the epoch; None when absent or unreadable."""
    if not isinstance(text, str) or not text:
        return None
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment.timestamp()

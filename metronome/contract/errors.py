"""Typed errors with messages meant for users. The HTTP layer maps them to status codes, the CLI to exit codes."""
from __future__ import annotations


class MetronomeError(Exception):
    """Base of every error Metronome raises on purpose."""


class InvalidRequestError(MetronomeError, ValueError):
    """The request cannot be served as given (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFoundError(MetronomeError, ValueError):
    """The model source or preset does not exist or cannot be read."""


class EngineOverloadedError(MetronomeError):
    """The waiting queue is full (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_seconds: float = 1.0):
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class EngineDrainingError(MetronomeError):
    """The server is shutting down and takes no new requests (HTTP 503)."""

"""A free TCP port on a loopback address, for the local servers the benchmarks start (the test support uses it too)."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on at `host` right now (the kernel's pick: a process that binds it later may
    still lose a race for it, which shows as a server that fails to start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

"""Loopback addresses for the servers: 127.0.0.2, 127.0.0.3, ... (all of 127.0.0.0/8 is local on Linux), one per
running pod (each with a free port: metronome.server.bench.processes). Traffic never leaves the machine and never goes
to a pod IP."""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable


class AddressPool:
    """Hands out the lowest free address in [first, last] of 127.0.0.0/8 and takes it back."""

    def __init__(self, first: str = "127.0.0.2", last: str = "127.0.0.254"):
        low, high = ipaddress.IPv4Address(first), ipaddress.IPv4Address(last)
        loopback = ipaddress.IPv4Network("127.0.0.0/8")
        if low not in loopback or high not in loopback or low > high:
            raise ValueError(f"address range {first}..{last} must lie within 127.0.0.0/8, in order")
        self._free = [str(ipaddress.IPv4Address(i)) for i in range(int(low), int(high) + 1)]
        self._taken: set[str] = set()

    def take(self, usable: Callable[[str], bool] = lambda address: True) -> str:
        """The lowest address nobody took that `usable` accepts (e.g. one whose port is free)."""
        for address in self._free:
            if address not in self._taken and usable(address):
                self._taken.add(address)
                return address
        raise RuntimeError(f"no usable loopback address left of {len(self._free)}")

    def give_back(self, address: str) -> None:
        self._taken.discard(address)


def port_is_free(address: str, port: int) -> bool:
    """Whether `port` can be bound on `address` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True

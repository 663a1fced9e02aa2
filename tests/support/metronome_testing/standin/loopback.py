"""Loopback addresses for the servers: 127.0.0.2, 127.0.0.3, ... (all of 127.0.0.0/8 is local on Linux), one per
running pod (each with a free port: metronome.server.bench.processes). Traffic never leaves the machine and never goes
to a pod IP."""
from __future__ import annotations

import ipaddress


class AddressPool:
    """Hands out the lowest free address in [first, last] of 127.0.0.0/8 and takes it back."""

    def __init__(self, first: str = "127.0.0.2", last: str = "127.0.0.254"):
        low, high = ipaddress.IPv4Address(first), ipaddress.IPv4Address(last)
        loopback = ipaddress.IPv4Network("127.0.0.0/8")
        if low not in loopback or high not in loopback or low > high:
            raise ValueError(f"address range {first}..{last} must lie within 127.0.0.0/8, in order")
        self._free = [str(ipaddress.IPv4Address(i)) for i in range(int(low), int(high) + 1)]
        self._taken: set[str] = set()

    def take(self) -> str:
        for address in self._free:
            if address not in self._taken:
                self._taken.add(address)
                return address
        raise RuntimeError(f"all {len(self._free)} loopback addresses are in use")

    def give_back(self, address: str) -> None:
        self._taken.discard(address)

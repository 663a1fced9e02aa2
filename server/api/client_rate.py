"""Per-client prompt-token rate limit: a token bucket per client, refilled at R prompt tokens/s (opt-in).

The shares (client_share.py) bound how many requests a client holds at once, not how fast it sends them: a
closed-loop client that is refused resends at once, and every request it gets in costs a prefill in the steps
the other clients' streams wait on. What bounds a tenant's load is a rate, as OpenAI-style services bound tokens
per minute per key; this is that, for prompt tokens (the prefill work), per second.

A client is the same identity as for the shares (client_share.client_identity). Each has a bucket of capacity B
tokens (`--prompt-token-burst-per-client`, default R x 1 s), refilled at R tokens/s (`--max-prompt-tokens-per-
second-per-client`). Unlike the shares it applies to a lone client too: it is a contract per client, not a split
of the server. A request costs its prompt tokens times its engine requests (each choice of `n`, each prompt of a
batch, as the shares count them), known once it is tokenized; it is admitted when the bucket holds that many, and
the bucket loses them. A request larger than B could never be admitted that way, so one is admitted when the
bucket is full and the bucket goes negative (debt): the client then waits until the debt is paid back, so the
long-run rate stays R whatever the request sizes. A refused request is not charged and gets 429 with
Retry-After = the whole seconds until the bucket holds enough (at least 1). A charge is refunded exactly when the
engine refuses the request (queue full, invalid prompt) before serving it; a request the engine took stays
charged, even if its client leaves before the first token (the engine may have prefilled it).

Memory stays bounded under many identities: a full bucket is the same as no bucket, so buckets that have refilled
are dropped when more than `max_clients` are tracked; if that is not enough (more than `max_clients` clients in
debt at once), the ones nearest to full are dropped too, forgiving the least debt. Used on the event loop only,
so it needs no lock.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.contract.errors import EngineOverloadedError

REJECT_REASON = "client_rate"  # metronome_requests_rejected_total{reason=...}
RATE_FLAG, BURST_FLAG = "--max-prompt-tokens-per-second-per-client", "--prompt-token-burst-per-client"
MAX_TRACKED_CLIENTS = 65536
_KEPT_AFTER_EVICTION = 3 / 4  # evict down to this fraction of max_clients, so eviction is amortised O(log n)
_LONGEST_KEY = 128  # longer identities (a long `user`) are keyed by a hash: a bucket costs O(1) memory
_SHOWN_NAME_CHARS = 64
_ROUNDING_TOKENS = 1e-6  # what clock arithmetic in floats may lose: a millionth of a token is not worth a 429


@dataclass(frozen=True)
class RateFlags:
    """`--max-prompt-tokens-per-second-per-client` (None: no limit) and `--prompt-token-burst-per-client`
    (None: one second's worth)."""

    tokens_per_second: int | None = None
    burst: int | None = None

    def __post_init__(self) -> None:
        if self.burst is not None and self.tokens_per_second is None:
            raise ValueError(f"{BURST_FLAG} needs {RATE_FLAG} (a burst of a bucket that is never refilled)")
        for flag, value in ((RATE_FLAG, self.tokens_per_second), (BURST_FLAG, self.burst)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")

    @property
    def capacity(self) -> int | None:
        if self.tokens_per_second is None:
            return None
        return self.burst if self.burst is not None else self.tokens_per_second


@dataclass
class Bucket:
    tokens: float  # at `updated`; negative while the client owes a request larger than the capacity
    updated: float  # clock seconds


def level(bucket: Bucket, rate: float, capacity: float, now: float) -> float:
    """What `bucket` holds at `now`."""
    return min(capacity, bucket.tokens + (now - bucket.updated) * rate)


def needed(cost: int, capacity: float) -> float:
    """What the bucket must hold to admit `cost` tokens: all of them, or a full bucket for a larger request."""
    return min(cost, capacity)


def wait_seconds(held: float, cost: int, rate: float, capacity: float) -> float:
    """Seconds until a bucket holding `held` can admit `cost` tokens (0: now; a request of no tokens costs
    nothing, even to a client in debt)."""
    short = needed(cost, capacity) - held
    if cost <= 0 or short <= _ROUNDING_TOKENS:
        return 0.0
    return short / rate


class ClientRateExceeded(EngineOverloadedError):
    """A client over its prompt-token rate: 429 with Retry-After, `code` for the error body."""

    code = "client_rate_exceeded"


@dataclass
class RateLimiter:
    """Every tracked client's bucket."""

    rate: float  # tokens per second
    capacity: float
    clock: Callable[[], float] = time.monotonic
    max_clients: int = MAX_TRACKED_CLIENTS
    buckets: dict[str, Bucket] = field(default_factory=dict)

    @classmethod
    def from_flags(cls, flags: RateFlags, clock: Callable[[], float] = time.monotonic) -> RateLimiter | None:
        """None when no rate is set."""
        if flags.tokens_per_second is None:
            return None
        return cls(float(flags.tokens_per_second), float(flags.capacity), clock)

    def charge(self, client: str, cost: int) -> RateCharge:
        """Take `cost` prompt tokens from `client`'s bucket, or raise ClientRateExceeded (nothing taken)."""
        now = self.clock()
        key = _key(client)
        bucket = self.buckets.get(key)
        held = self.capacity if bucket is None else level(bucket, self.rate, self.capacity, now)
        wait = wait_seconds(held, cost, self.rate, self.capacity)
        if wait > 0:
            raise ClientRateExceeded(self._refusal(client, cost, held, wait), retry_after_seconds=wait)
        if bucket is None:
            self._make_room(now)
            bucket = self.buckets[key] = Bucket(held, now)
        bucket.tokens, bucket.updated = held - cost, now
        return RateCharge(self, key, cost)

    def refund(self, key: str, cost: int) -> None:
        """Give back a charge as if it had never been made (below the capacity the bucket is linear in it)."""
        bucket = self.buckets.get(key)
        if bucket is None:  # dropped: it was full, or the most nearly full of too many
            return
        now = self.clock()
        bucket.tokens, bucket.updated = min(self.capacity, level(bucket, self.rate, self.capacity, now) + cost), now

    def _make_room(self, now: float) -> None:
        if len(self.buckets) < self.max_clients:
            return
        levels = {key: level(b, self.rate, self.capacity, now) for key, b in self.buckets.items()}
        for key, held in levels.items():
            if held >= self.capacity:
                del self.buckets[key]
        keep = int(self.max_clients * _KEPT_AFTER_EVICTION)
        if len(self.buckets) >= self.max_clients:
            for key in sorted(self.buckets, key=levels.__getitem__, reverse=True)[:len(self.buckets) - keep]:
                del self.buckets[key]

    def _refusal(self, client: str, cost: int, held: float, wait: float) -> str:
        name = client if len(client) <= _SHOWN_NAME_CHARS else client[:_SHOWN_NAME_CHARS] + "..."
        larger = cost > self.capacity
        return (f"client {name!r} asks for {cost} prompt tokens and has {max(held, 0.0):.0f} of "
                f"{self.capacity:.0f} left"
                + (f" ({-held:.0f} owed)" if held < 0 else "")
                + f" (rate limit {RATE_FLAG} {self.rate:.0f}, {BURST_FLAG} {self.capacity:.0f}"
                + ("; a request larger than the burst waits for a full bucket" if larger else "")
                + f"); retry in {wait:.1f} s")


@dataclass
class RateCharge:
    """The tokens one HTTP request was charged; `refund` is idempotent."""

    limiter: RateLimiter
    key: str
    cost: int
    refunded: bool = False

    def refund(self) -> None:
        if not self.refunded:
            self.refunded = True
            self.limiter.refund(self.key, self.cost)


def _key(client: str) -> str:
    if len(client) <= _LONGEST_KEY:
        return client
    return "sha256:" + hashlib.sha256(client.encode("utf-8", "surrogatepass")).hexdigest()

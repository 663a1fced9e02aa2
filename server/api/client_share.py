"""Per-client fair admission: no client may take the whole waiting queue or the running slots from the others.

Who is a client (`client_identity`), in this order:
1. the API key, when the server has keys (`--api-key`): the middleware has checked it, so it is the real
   boundary between tenants; the key itself is never stored or shown, only a short hash of it;
2. else the OpenAI `user` field of the body: only as trustworthy as the callers, since anyone can write any
   name there (a client that splits itself into many names gets many shares) — use keys between untrusted tenants;
3. else the peer address (behind a proxy or Service that hides the peers, every caller is one client, so the
   shares never apply and only the global limits do).

What a client holds, counted per engine request (a choice of `n`, a prompt of a batch), from admission to the end
of its response: `waiting` until its first token (being tokenized, in the queue, or in prefill: its claim on the
scheduler's prefill budget), `running` after that.

The share (`fair_share`): while a client is the only one with requests in flight, nothing changes — it may use the
whole `--max-waiting` and `--max-num-seqs`, as before. While others are active too, it may hold at most
limit // active_clients of each (at least 1), capped further by `--max-waiting-per-client` /
`--max-running-per-client` when given. The shares of all active clients add up to at most the limit (while there are
no more clients than the limit), so a client within its share is not refused by the global limit as long as the
others are within theirs; a lone client is never throttled; and there is no tuning to get wrong by default.
The running share counts the client's waiting requests too, because the scheduler runs a waiting request as
soon as it can: so running ≤ share holds without the scheduler knowing about clients. Shares are checked at
admission only: when a second client arrives, nothing the first already holds is evicted; the first one's new
requests get 429 until it is under its share again.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from metronome.contract.errors import EngineOverloadedError

REJECT_REASON = "client_share"  # metronome_requests_rejected_total{reason=...}
RETRY_AFTER_SECONDS = 1.0
_SHOWN_NAME_CHARS = 64


def client_identity(api_key: str | None, user: str | None, peer: str | None) -> str:
    """The client a request counts for (precedence in the module doc). `api_key`: the checked key, or None when
    the server has no keys."""
    if api_key:
        return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:12]
    if user:
        return "user:" + user
    return "addr:" + (peer or "unknown")


def bearer_token(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (ApiKeyAuth has already checked it)."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def fair_share(limit: int, per_client: int | None, active_clients: int) -> int | None:
    """What one of `active_clients` clients (itself included) may hold of `limit`; None means no per-client cap
    (it is alone: the global limit alone applies)."""
    if active_clients <= 1:
        return None
    share = max(1, limit // active_clients)
    if per_client is not None:
        share = min(share, per_client)
    return min(share, limit)


@dataclass(frozen=True)
class ShareFlags:
    """`--max-waiting-per-client` and `--max-running-per-client` (None: the fair share alone)."""

    max_waiting_per_client: int | None = None
    max_running_per_client: int | None = None


@dataclass
class ClientLoad:
    waiting: int = 0
    running: int = 0

    @property
    def in_flight(self) -> int:
        return self.waiting + self.running


class ClientShareExceeded(EngineOverloadedError):
    """A client over its share: 429 with Retry-After, `code` for the error body."""

    code = "client_share_exceeded"


def refusal(client: str, load: ClientLoad, jobs: int, others_active: int, max_waiting: int, max_running: int,
            flags: ShareFlags) -> str | None:
    """Why `jobs` more engine requests of `client` (holding `load`) are refused, or None when they fit its share."""
    active = others_active + 1
    name = client if len(client) <= _SHOWN_NAME_CHARS else client[:_SHOWN_NAME_CHARS] + "..."
    waiting_share = fair_share(max_waiting, flags.max_waiting_per_client, active)
    if waiting_share is not None and load.waiting + jobs > waiting_share:
        return (f"client {name!r} has {load.waiting} request(s) waiting for a first token and asks for {jobs} more; "
                f"its share of the waiting queue is {waiting_share} while {active} clients are active "
                f"(--max-waiting {max_waiting} / {active}"
                + _cap_note("--max-waiting-per-client", flags.max_waiting_per_client) + "); retry later")
    running_share = fair_share(max_running, flags.max_running_per_client, active)
    if running_share is not None and load.in_flight + jobs > running_share:
        return (f"client {name!r} has {load.in_flight} request(s) running or waiting and asks for {jobs} more; "
                f"its share of the running requests is {running_share} while {active} clients are active "
                f"(--max-num-seqs {max_running} / {active}"
                + _cap_note("--max-running-per-client", flags.max_running_per_client) + "); retry later")
    return None


def _cap_note(flag: str, value: int | None) -> str:
    return "" if value is None else f", at most {flag} {value}"


@dataclass
class ClientLedger:
    """What every client holds now. Used on the event loop only, so it needs no lock."""

    flags: ShareFlags = field(default_factory=ShareFlags)
    loads: dict[str, ClientLoad] = field(default_factory=dict)

    def admit(self, client: str, jobs: int, max_waiting: int, max_running: int) -> ClientHold:
        """Take `jobs` waiting slots for `client`, or raise ClientShareExceeded (nothing taken)."""
        load = self.loads.get(client) or ClientLoad()
        others = len(self.loads) - (client in self.loads)
        reason = refusal(client, load, jobs, others, max_waiting, max_running, self.flags)
        if reason is not None:
            raise ClientShareExceeded(reason, retry_after_seconds=RETRY_AFTER_SECONDS)
        load.waiting += jobs
        self.loads[client] = load
        return ClientHold(self, client, ["waiting"] * jobs)

    def _move(self, client: str, state: str, to: str | None) -> None:
        load = self.loads[client]
        setattr(load, state, getattr(load, state) - 1)
        if to is not None:
            setattr(load, to, getattr(load, to) + 1)
        if load.in_flight == 0:
            del self.loads[client]  # an idle client is not active: it no longer shrinks the others' shares


@dataclass
class ClientHold:
    """The slots one HTTP request holds, one per engine request; every method is idempotent."""

    ledger: ClientLedger
    client: str
    states: list[str]  # per job: "waiting" | "running" | "done"

    def first_token(self, job: int) -> None:
        if self.states[job] == "waiting":
            self.ledger._move(self.client, "waiting", "running")
            self.states[job] = "running"

    def finish(self, job: int) -> None:
        if self.states[job] != "done":
            self.ledger._move(self.client, self.states[job], None)
            self.states[job] = "done"

    def release(self) -> None:
        for job in range(len(self.states)):
            self.finish(job)

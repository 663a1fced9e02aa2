"""Leader election on a coordination.k8s.io/v1 Lease: with several operator replicas exactly one runs kopf.

The rules are client-go's (the kube-controller-manager's and controller-runtime's): a replica takes the Lease
when it is free or its holder has not renewed it for `leaseDurationSeconds`, measured on the taker's own
monotonic clock from the moment it last saw the record change (so clocks of different nodes never compare);
the holder renews every retry period and gives up — stops acting and exits, so that its pod restarts as a
candidate — when it could not renew for the renew deadline, which is shorter than the lease so the old leader
has stopped before anyone may take over. Every write is a replace with the read resourceVersion: of two
candidates racing for a free Lease one gets 409 Conflict and stays a candidate. On a clean stop the holder
releases the Lease (empty holder), so a rolling update hands over at once instead of after a lease duration.

A holder's writes are fenced (`Leadership.check`, called by k8s.Kube before every write): a write leaves only
while the last renewal is younger than the renew deadline on this replica's own monotonic clock. A leader paused
(SIGSTOP, a VM stall) past the deadline finds on waking that its clock moved on and writes nothing, even before
its renew thread has noticed: the standby may hold the Lease by then, and an old leader's write would undo the
new one's.

`plan` is the pure decision; `LeaderElector` is the I/O around it; `StandbyHealth` answers the liveness probe
while a replica waits (kopf's own endpoint starts only with kopf).
"""
from __future__ import annotations

import datetime as dt
import http.server
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ACQUIRE, RENEW, WAIT = "acquire", "renew", "wait"
JITTER = 1.2  # client-go's JitterFactor: the renew deadline must leave room for jittered retries

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseTimes:
    duration_s: float = 15.0  # --lease-duration: how long a candidate waits for a silent holder
    renew_deadline_s: float = 10.0  # --lease-renew-deadline: the holder stops acting after this long unrenewed
    retry_period_s: float = 2.0  # --lease-retry-period: between attempts to take or renew

    def __post_init__(self) -> None:
        if not self.duration_s > self.renew_deadline_s:
            raise ValueError(f"--lease-duration ({self.duration_s:g} s) must exceed --lease-renew-deadline "
                             f"({self.renew_deadline_s:g} s)")
        if not self.renew_deadline_s > JITTER * self.retry_period_s:
            raise ValueError(f"--lease-renew-deadline ({self.renew_deadline_s:g} s) must exceed {JITTER} x "
                             f"--lease-retry-period ({self.retry_period_s:g} s)")
        if self.retry_period_s <= 0:
            raise ValueError(f"--lease-retry-period must be > 0, got {self.retry_period_s:g}")


@dataclass(frozen=True)
class LeaseRecord:
    """The fields of a Lease's spec that election reads, plus its resourceVersion."""

    holder: str | None
    duration_s: float
    acquire_time: str | None
    renew_time: str | None
    transitions: int
    resource_version: str | None


def plan(record: LeaseRecord | None, identity: str, seen_for_s: float) -> str:
    """What a replica does with the Lease as it reads it now. `seen_for_s`: how long the record has been
    unchanged on this replica's clock (0 when it changed since the last read)."""
    if record is None or record.holder is None:
        return ACQUIRE
    if record.holder == identity:
        return RENEW
    if seen_for_s >= record.duration_s:
        return ACQUIRE  # the holder went silent for a whole lease
    return WAIT


def micro_time(now: dt.datetime | None = None) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC)."""
    return (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def next_spec(record: LeaseRecord | None, identity: str, times: LeaseTimes, now: str) -> dict[str, Any]:
    """The Lease spec that takes (or renews) the Lease for `identity`."""
    renewing = record is not None and record.holder == identity
    transitions = record.transitions if record is not None else 0
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": max(1, round(times.duration_s)),
        "acquireTime": record.acquire_time if renewing and record.acquire_time else now,
        "renewTime": now,
        "leaseTransitions": transitions if renewing or record is None or record.holder is None else transitions + 1,
    }


class LeaderElector:
    """Takes, keeps and releases one Lease through the official client's CoordinationV1Api."""

    def __init__(self, namespace: str, name: str, identity: str, times: LeaseTimes = LeaseTimes(),
                 api_client: Any = None, clock: Callable[[], float] = time.monotonic):
        import kubernetes

        self.namespace, self.name, self.identity, self.times = namespace, name, identity, times
        self._api = kubernetes.client.CoordinationV1Api(api_client or kubernetes.client.ApiClient())
        self._clock = clock
        self._seen: tuple[Any, ...] | None = None
        self._seen_at = clock()
        self.last_renewed: float | None = None  # our clock, when we last held the Lease
        self.lost = False  # set once for good: a replica that lost the Lease never writes again
        self.released = False

    def holds_now(self) -> bool:
        """May this replica write now: it renewed the Lease less than the renew deadline ago, and never lost it."""
        if self.lost or self.last_renewed is None:
            return False
        return self._clock() - self.last_renewed < self.times.renew_deadline_s

    # --- one attempt ---------------------------------------------------------------------------------------

    def try_acquire_or_renew(self) -> bool:
        """One read and at most one write; True when this replica holds the Lease afterwards."""
        import kubernetes

        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
            record = _record_of(lease)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            lease, record = None, None
        now = self._clock()
        key = None if record is None else (record.holder, record.renew_time, record.resource_version)
        if key != self._seen:
            self._seen, self._seen_at = key, now
        action = plan(record, self.identity, now - self._seen_at)
        if action == WAIT:
            return False
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": next_spec(record, self.identity, self.times, micro_time())}
        try:
            if lease is None:
                self._api.create_namespaced_lease(self.namespace, body, _request_timeout=5)
            else:
                body["metadata"]["resourceVersion"] = record.resource_version
                self._api.replace_namespaced_lease(self.name, self.namespace, body, _request_timeout=5)
        except kubernetes.client.ApiException as exc:
            if exc.status in (409, 422):  # someone else wrote first (conflict / already exists)
                return False
            raise
        if action == ACQUIRE:
            log.info("leader election: %s took Lease %s/%s (was %s)", self.identity, self.namespace, self.name,
                     record.holder if record else "free")
        self.last_renewed = now if not self.lost else self.last_renewed
        return True

    def _attempt(self) -> bool:
        try:
            return self.try_acquire_or_renew()
        except Exception as exc:  # noqa: BLE001 - an API hiccup is one failed attempt, not a crash
            log.warning("leader election: Lease %s/%s: %s", self.namespace, self.name, exc)
            return False

    # --- the phases ----------------------------------------------------------------------------------------

    def acquire(self, stop: threading.Event) -> bool:
        """Block until this replica holds the Lease (True) or `stop` is set (False)."""
        log.info("leader election: %s waiting for Lease %s/%s", self.identity, self.namespace, self.name)
        while not stop.is_set():
            if self._attempt():
                return True
            stop.wait(self.times.retry_period_s * random.uniform(1.0, JITTER))
        return False

    def keep(self, stop: threading.Event, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew in a thread until `stop`; call `on_lost` once (and end) when the renew deadline passes."""

        def renew() -> None:
            while not stop.wait(self.times.retry_period_s):
                if self._attempt():
                    continue
                unrenewed = self._clock() - (self.last_renewed or 0.0)
                if unrenewed >= self.times.renew_deadline_s or not self._still_ours():
                    self.lost = True
                    log.error("leader election: %s lost Lease %s/%s (not renewed for %.1f s)", self.identity,
                              self.namespace, self.name, unrenewed)
                    on_lost()
                    return

        thread = threading.Thread(target=renew, name="lease-renew", daemon=True)
        thread.start()
        return thread

    def _still_ours(self) -> bool:
        """False when the last read showed another holder (someone took over: stop at once)."""
        return self._seen is None or self._seen[0] in (None, self.identity)

    def stand_down(self) -> None:
        """Stop writing (the fence closes for good), then hand the Lease back; once only."""
        if self.released:
            return
        self.released = True
        self.lost = True
        self.release()

    def release(self) -> None:
        """Hand the Lease back (empty holder, 1 s lease), if this replica still holds it: the next candidate takes
        it at its next attempt instead of waiting a whole lease duration."""
        import kubernetes

        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
            record = _record_of(lease)
            if record.holder != self.identity:
                return
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace,
                                 "resourceVersion": record.resource_version},
                    "spec": {"holderIdentity": None, "leaseDurationSeconds": 1, "acquireTime": record.acquire_time,
                             "renewTime": micro_time(), "leaseTransitions": record.transitions}}
            self._api.replace_namespaced_lease(self.name, self.namespace, body, _request_timeout=5)
            log.info("leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name)
        except (kubernetes.client.ApiException, OSError) as exc:
            log.warning("leader election: could not release Lease %s/%s: %s", self.namespace, self.name, exc)


def _record_of(lease: Any) -> LeaseRecord:
    """LeaseRecord from the client's V1Lease (its MicroTimes kept as the strings the API sent)."""
    spec, meta = lease.spec, lease.metadata

    def text(value: Any) -> str | None:
        if value is None:
            return None
        return micro_time(value) if isinstance(value, dt.datetime) else str(value)

    return LeaseRecord(holder=spec.holder_identity or None, duration_s=float(spec.lease_duration_seconds or 0),
                       acquire_time=text(spec.acquire_time), renew_time=text(spec.renew_time),
                       transitions=int(spec.lease_transitions or 0), resource_version=meta.resource_version)


class Leadership:
    """The fence of every write (k8s.Kube's `fence`): `check` raises LeadershipLost unless this replica holds the
    Lease now (always passes when it runs standalone, without an elector)."""

    def __init__(self, elector: LeaderElector | None = None):
        self.elector = elector

    def check(self) -> None:
        from metronome.operator.k8s import LeadershipLost

        if self.elector is not None and not self.elector.holds_now():
            raise LeadershipLost(f"{self.elector.identity} does not hold Lease {self.elector.namespace}/"
                                 f"{self.elector.name} now: not writing")


class StandbyHealth:
    """GET /healthz → 200 'standby' while this replica waits for the Lease (a waiting replica is alive; the
    liveness probe must not restart it). Closed before kopf binds the same port for its own endpoint."""

    def __init__(self, host: str, port: int):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                code, text = (200, b"standby\n") if self.path.split("?")[0] == "/healthz" else (404, b"not found\n")
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: Any) -> None:
                pass

        http.server.ThreadingHTTPServer.allow_reuse_address = True
        self._server = http.server.ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="standby-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

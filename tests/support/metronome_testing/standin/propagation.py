"""When a changed ConfigMap reaches a pod's volume: the kubelet's propagation delay, modelled.

A real kubelet does not watch the ConfigMaps behind mounted volumes. It re-projects a pod's volumes at the pod's
periodic sync (`syncFrequency`, 1 min by default) and reads ConfigMaps through a cache with a TTL, so a change
lands tens of seconds to ~2 min after the write (30-90 s is typical on a real node). The stand-in plays this as:
a change first seen at t is projected at t + d, with d drawn uniformly from [low, high] per pod and change; if the
content changes again before then, the newest content is projected at the same moment (the kubelet projects
whatever it reads at its sync). A pod's first projection is immediate: the kubelet mounts volumes with the
current content before the container starts.

The range comes from `StandInOptions.config_delay`, else from $METRONOME_STANDIN_CONFIG_DELAY ("30-90", "5-15",
"0"), else 30-90 s. Everything here is pure: the clock and the random source are passed in.
"""
from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

ENV = "METRONOME_STANDIN_CONFIG_DELAY"
_RANGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:-\s*(\d+(?:\.\d+)?)\s*)?s?\s*$")


@dataclass(frozen=True)
class DelayRange:
    """Seconds between the stand-in seeing a ConfigMap change and projecting it: uniform in [low_s, high_s]."""

    low_s: float
    high_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.low_s <= self.high_s:
            raise ValueError(f"config delay needs 0 <= low <= high, got {self.low_s:g}-{self.high_s:g} s")

    @classmethod
    def parse(cls, text: str, where: str = ENV) -> DelayRange:
        """'30-90' (seconds, a uniform range), '5' (fixed), '0' (immediate)."""
        match = _RANGE.match(text)
        if not match:
            raise ValueError(f"{where}: expected seconds as LOW-HIGH (e.g. 30-90) or one number, got {text!r}")
        low = float(match.group(1))
        high = float(match.group(2)) if match.group(2) is not None else low
        try:
            return cls(low, high)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> DelayRange:
        text = environ.get(ENV)
        return cls.parse(text) if text else KUBELET_DEFAULT

    def draw(self, rng: random.Random) -> float:
        return rng.uniform(self.low_s, self.high_s) if self.high_s > self.low_s else self.low_s

    def describe(self) -> str:
        if self.high_s == self.low_s:
            return "immediate" if self.low_s == 0 else f"{self.low_s:g} s"
        return f"{self.low_s:g}-{self.high_s:g} s"


KUBELET_DEFAULT = DelayRange(30.0, 90.0)  # sync period (1 min) plus the ConfigMap cache TTL, as on a real node


@dataclass(frozen=True)
class ConfigUpdate:
    """One change of one pod's volume, from the moment the stand-in saw it to the moment it was projected."""

    volume: str  # "<pod key> <mount path>"
    summary: str  # e.g. "server.yaml generation 4"
    seen_at: float
    due_at: float
    applied_at: float | None = None

    @property
    def delay_s(self) -> float:
        return self.due_at - self.seen_at


@dataclass
class Propagation:
    """Decides, at every sync pass, whether a volume's new content may be projected now."""

    delay: DelayRange
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    keep: int = 100  # updates remembered for `history`
    _pending: dict[str, tuple[ConfigUpdate, Mapping[str, str]]] = field(default_factory=dict)
    _history: list[ConfigUpdate] = field(default_factory=list)

    def ready(self, volume: str, wanted: Mapping[str, str], projected: Mapping[str, str] | None) -> bool:
        """True when `wanted` should be projected into the volume now (the caller then projects it)."""
        now = self.clock()
        if projected is None:  # first mount, before the container starts
            self._pending.pop(volume, None)
            return True
        if dict(wanted) == dict(projected):
            self._pending.pop(volume, None)  # changed back before the sync: nothing to do
            return False
        entry = self._pending.get(volume)
        update = entry[0] if entry else ConfigUpdate(volume, summarize(wanted), now, now + self.delay.draw(self.rng))
        if now < update.due_at:
            self._pending[volume] = (replace(update, summary=summarize(wanted)), dict(wanted))
            return False
        self._pending.pop(volume, None)
        self._remember(replace(update, summary=summarize(wanted), applied_at=now))
        return True

    def forget(self, prefix: str) -> None:
        """Drop pending changes of volumes whose name starts with `prefix` (a pod that went away)."""
        for volume in [v for v in self._pending if v.startswith(prefix)]:
            del self._pending[volume]

    def pending(self) -> list[ConfigUpdate]:
        return sorted((update for update, _ in self._pending.values()), key=lambda u: u.seen_at)

    def history(self) -> list[ConfigUpdate]:
        return list(self._history)

    def _remember(self, update: ConfigUpdate) -> None:
        self._history.append(update)
        del self._history[:-self.keep]


def summarize(files: Mapping[str, str]) -> str:
    """'server.yaml generation 4' for each file with a top-level `generation: N` line, else the file names."""
    parts = []
    for name, text in sorted(files.items()):
        match = re.search(r"^generation:\s*(\d+)\s*$", text, re.MULTILINE)
        parts.append(f"{name} generation {match.group(1)}" if match else name)
    return ", ".join(parts) or "(no files)"

"""Which Prometheus monitor the operator writes for each InferenceService, from its flags (the chart's
`monitor.*` values): a PodMonitor per service with the labels a Prometheus selects monitors by (a stock
kube-prometheus-stack selects `release: <its release name>`), or none — when the chart's one ServiceMonitor
covers every server Service, or Prometheus discovers pods by their `prometheus.io/*` annotations. Never both:
each would scrape every pod once and every rate (tokens per second) would read double. So the pods carry those
annotations only while the operator writes no PodMonitor for them (--scrape-annotations auto), unless told
otherwise (always; never, e.g. under the chart's ServiceMonitor).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

POD_MONITOR = "PodMonitor"
NONE = "none"
KINDS = (POD_MONITOR, NONE)
AUTO, ALWAYS, NEVER = "auto", "always", "never"
ANNOTATION_MODES = (AUTO, ALWAYS, NEVER)

# A label key (optional DNS-subdomain prefix, then a name) and value, as Kubernetes validates them.
_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class MonitorSettings:
    kind: str = POD_MONITOR  # PodMonitor (written only where the cluster serves that API) or none
    labels: tuple[tuple[str, str], ...] = ()  # added to each PodMonitor's metadata.labels
    interval_seconds: float | None = None  # the PodMonitor's scrape interval; None: picked from the window
    scrape_annotations: str = AUTO  # prometheus.io/* on the pods: auto (only with kind none), always, never

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--monitor-kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.scrape_annotations not in ANNOTATION_MODES:
            raise ValueError(f"--scrape-annotations must be one of {', '.join(ANNOTATION_MODES)}, got "
                             f"{self.scrape_annotations!r}")

    @property
    def pod_monitors(self) -> bool:
        return self.kind == POD_MONITOR

    def annotate_pods(self, pod_monitor: bool) -> bool:
        """Whether a service's pods carry the prometheus.io/* scrape annotations (`pod_monitor`: the operator
        writes a PodMonitor for them)."""
        return self.scrape_annotations == ALWAYS or (self.scrape_annotations == AUTO and not pod_monitor)


def parse_label(text: str, flag: str = "--monitor-label") -> tuple[str, str]:
    """'key=value' → (key, value), checked as Kubernetes checks label keys and values."""
    key, sep, value = text.partition("=")
    if not sep or not _KEY.match(key) or len(key.rpartition("/")[0]) > 253 or not _VALUE.match(value):
        raise ValueError(f"{flag}: not a label key=value: {text!r}")
    return key, value

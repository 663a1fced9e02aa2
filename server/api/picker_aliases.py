"""The endpoint picker's series (vLLM's names, metronome.contract.metric_names.PICKER_ALIASES), computed at scrape
time from the Metronome families of the same scrape, so an alias can never disagree with the series it stands for.

`alias_families(families)` is pure: for each alias it takes the source family's samples, renames the labels the
alias keeps and sums the samples that then coincide (the waiting queues add up to one queue). `WithAliases`
wraps a registry (or the multiprocess collector's merged one) so that `generate_latest` writes both.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from metronome.contract.metric_names import PICKER_ALIASES, PickerAlias


def alias_family(alias: PickerAlias, source: Metric) -> GaugeMetricFamily:
    """One alias from its source family: samples of the source's own name (not _bucket and the like), labels
    renamed, the rest summed away."""
    kept = dict(alias.labels)
    totals: dict[tuple[str, ...], float] = {}
    for sample in source.samples:
        if sample.name != source.name:
            continue
        key = tuple(sample.labels.get(label, "") for label in kept)
        totals[key] = totals.get(key, 0.0) + sample.value
    family = GaugeMetricFamily(alias.name, f"{source.documentation} (alias of {source.name} for the endpoint "
                               f"picker)", labels=list(kept.values()))
    for key, value in sorted(totals.items()):
        family.add_metric(list(key), value)
    return family


def alias_families(families: Iterable[Metric]) -> list[GaugeMetricFamily]:
    """Every alias whose source family is among `families` and has samples."""
    by_name = {family.name: family for family in families}
    out = []
    for alias in PICKER_ALIASES:
        source = by_name.get(alias.source)
        if source is not None and any(sample.name == source.name for sample in source.samples):
            out.append(alias_family(alias, source))
    return out


class WithAliases:
    """A collector view of `registry` that yields its families, then their aliases (for generate_latest)."""

    def __init__(self, registry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        families = list(self.registry.collect())
        yield from families
        yield from alias_families(families)

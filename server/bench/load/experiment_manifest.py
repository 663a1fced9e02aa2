"""`bench sweep --emit-experiment PATH --service NAME`: the sweep's recommendation as a live trial, pure.

The sweep finds the best configuration on a simulated load; an experiment (spec.experiment, docs/operator.md)
then tries it on a slice of a running service's pods against real traffic, and promotes or reverts it. The
manifest names the service and sets only spec.experiment, so it is applied as a patch of the existing resource:

    kubectl patch inferenceservice NAME -n NS --type merge --patch-file PATH

(or `kubectl apply --server-side --field-manager metronome-sweep -f PATH`). The candidate is the fields the sweep
set (sweep.swept_fields): the chunk size and queue policy it measured, laid over the service's own config when the
experiment starts; everything else is the experiment's defaults, to be edited before applying.
"""
from __future__ import annotations

import re

import yaml
from pydantic.alias_generators import to_camel

from metronome.server.bench.load.sweep import Choice, Recommendation, SweepConfig, SweepError, swept_fields

SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # the CRD's rule for metadata.name (≤ 50 characters)
API_VERSION = "metronome.dev/v1alpha1"


def check_service_name(name: str, flag: str = "--service") -> str:
    if len(name) > 50 or not SERVICE_NAME.match(name):
        raise SweepError(f"{flag}: {name!r} is not an InferenceService name (a DNS-1035 label of at most 50 "
                         "characters: lower case letters, digits and '-', starting with a letter)")
    return name


def candidate_of(choice: Choice) -> dict:
    """The sweep's fields of the chosen configuration, camelCase as spec.experiment.candidate takes them."""
    return {to_camel(key): value for key, value in swept_fields(SweepConfig(choice.chunk_size,
                                                                            choice.queue_policy)).items()}


def experiment_manifest(recommendation: Recommendation, service: str, namespace: str | None = None) -> str:
    """The YAML manifest (a header comment says what the sweep measured). Raises SweepError when no
    configuration met the SLO: there is nothing to try."""
    best = recommendation.best
    if best is None:
        raise SweepError(f"--emit-experiment: no configuration met the {recommendation.slo_tbt_ms:g} ms TBT SLO, so "
                         f"there is no candidate ({recommendation.note})")
    policy = best.queue_policy
    metadata = {"name": check_service_name(service)}
    if namespace:
        metadata["namespace"] = namespace
    body = {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": metadata,
            "spec": {"experiment": {"name": f"sweep-{policy}-{best.chunk_size}", "candidate": candidate_of(best)}}}
    rate = f" at {best.rate:g} req/s" if best.rate is not None else ""
    measured = [f"{best.output_tokens_per_s:.1f} output tok/s{rate}"]
    if best.tbt_p99_ms is not None:
        measured.append(f"TBT p99 {best.tbt_p99_ms:.1f} ms")
    if best.ttft_p99_ms is not None:
        measured.append(f"TTFT p99 {best.ttft_p99_ms:.1f} ms")
    header = (f"# metronome bench sweep: chunk {best.chunk_size} / {policy} met the {recommendation.slo_tbt_ms:g} ms "
              f"TBT SLO with the most throughput ({', '.join(measured)}).\n"
              f"# Apply: kubectl patch inferenceservice {service}{' -n ' + namespace if namespace else ''} "
              "--type merge --patch-file THIS_FILE\n")
    return header + yaml.safe_dump(body, sort_keys=False)

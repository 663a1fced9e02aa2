"""What an experiment changes in the cluster, as objects and patches. Pure (the glue writes them).

The candidate slice is a set of the service's running pods, relabelled `metronome.dev/variant=candidate`; every
other pod is labelled `control`. Why relabel pods rather than run a second Deployment for the candidate:
- no pod starts or stops: the candidate pods are as warm as the control pods (weights loaded, kernels compiled,
  prefix cache filled), so the comparison measures the config, not a cold start; on GPUs a second Deployment
  would also need free GPUs, or take pods away from the service while new ones load;
- a label is not in the Deployment's selector, so the ReplicaSet neither adopts nor replaces a relabelled pod,
  and the Service, the PodDisruptionBudget, the PodMonitor and an InferencePool (all select the selector labels)
  keep spreading traffic over both groups;
- the kubelet projects a pod's labels into its downward-API file at its periodic sync, like a ConfigMap, and the
  pods' one projected config volume holds both configs and the labels (builders.config_volume), so a pod
  switches config by a label, with the same `..data` reload and no restart.

A pod that the ReplicaSet creates meanwhile (a replacement, a scale-up) has no variant label and serves the
control config: it joins the control group.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metronome.contract import variant
from metronome.contract.config import ServerConfigFile
from metronome.operator import builders
from metronome.operator.configmap import ANNOTATION_CONFIG_GENERATION, CONFIG_KEY, render
from metronome.operator.spec import InferenceService

ANNOTATION_EXPERIMENT = "metronome.dev/experiment"  # on the candidate ConfigMap: the experiment's identity


@dataclass(frozen=True)
class PodView:
    """One server pod of the service, as an experiment needs it."""

    name: str
    ready: bool
    variant: str  # its variant label now (CONTROL when it has none)
    labelled: bool = False  # it carries the variant label at all


def pod_views(pods: Iterable[Mapping[str, Any]]) -> tuple[PodView, ...]:
    """The service's pods that are not being deleted (API JSON), sorted by name."""
    views = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        if metadata.get("deletionTimestamp") or not metadata.get("name"):
            continue
        conditions = (pod.get("status") or {}).get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        labels = metadata.get("labels") or {}
        views.append(PodView(metadata["name"], ready, variant.variant_of(labels), variant.LABEL in labels))
    return tuple(sorted(views, key=lambda v: v.name))


def choose_candidates(pods: Sequence[PodView], count: int) -> tuple[str, ...]:
    """`count` ready pods, the first by name: deterministic, so a restarted operator picks the same ones."""
    return tuple(sorted(p.name for p in pods if p.ready)[:count])


def label_changes(pods: Sequence[PodView], candidates: Iterable[str], everyone: bool) -> dict[str, str]:
    """Pod → variant for the pods whose label must change. With `everyone` (an experiment is on) `candidates` are
    labelled CANDIDATE and every other pod CONTROL; without it (it is over) only pods still labelled candidate
    go back to CONTROL, and services that never ran an experiment get no label at all."""
    chosen = set(candidates)
    changes = {}
    for pod in pods:
        if everyone:
            wanted = variant.CANDIDATE if pod.name in chosen else variant.CONTROL
            if pod.variant != wanted or not pod.labelled:
                changes[pod.name] = wanted
        elif pod.variant == variant.CANDIDATE:
            changes[pod.name] = variant.CONTROL
    return changes


def label_patch(value: str) -> dict[str, Any]:
    """The merge patch that sets a pod's variant label (a label outside the selector: nothing rolls)."""
    return {"metadata": {"labels": {variant.LABEL: value}}}


def candidate_config_map(service: InferenceService, config: ServerConfigFile, experiment_id: str) -> dict[str, Any]:
    """The candidate's ConfigMap: server.yaml as in the service's own, under the candidate's name."""
    names = builders.child_names(service.name)
    rendered = render(config)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names.candidate_config_map,
            "namespace": service.namespace,
            "labels": builders.labels(service.name),
            "annotations": {ANNOTATION_CONFIG_GENERATION: str(config.generation),
                            ANNOTATION_EXPERIMENT: experiment_id},
            "ownerReferences": [service.owner_reference],
        },
        "data": {CONFIG_KEY: rendered.text},
    }

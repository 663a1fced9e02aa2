"""The kinds of object the operator writes or reads, each named once: API version, REST plural and, for the kinds
of other projects, the CRD that must be served before it writes one (prometheus-operator's PodMonitor and
PrometheusRule, the Gateway API Inference Extension's InferencePool). The watches (handlers.py), the REST paths
(k8s.py), the children's sync (reconcile.py) and the chart's RBAC follow this table. Besides the children, the
other autoscalers that may set a service's replicas (an HPA, a KEDA ScaledObject) are watched, never written.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    kind: str
    api_version: str
    plural: str
    crd: str | None = None  # an optional kind: written only while the cluster serves this CRD
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


INFERENCE_SERVICE = Kind("InferenceService", "metronome.dev/v1alpha1", "inferenceservices")
CONFIG_MAP = Kind("ConfigMap", "v1", "configmaps")
DEPLOYMENT = Kind("Deployment", "apps/v1", "deployments")
SERVICE = Kind("Service", "v1", "services")
DISRUPTION_BUDGET = Kind("PodDisruptionBudget", "policy/v1", "poddisruptionbudgets")
POD_MONITOR = Kind("PodMonitor", "monitoring.coreos.com/v1", "podmonitors", crd="podmonitors.monitoring.coreos.com")
PROMETHEUS_RULE = Kind("PrometheusRule", "monitoring.coreos.com/v1", "prometheusrules",
                       crd="prometheusrules.monitoring.coreos.com")
INFERENCE_POOL = Kind("InferencePool", "inference.networking.k8s.io/v1", "inferencepools",
                      crd="inferencepools.inference.networking.k8s.io")
POD = Kind("Pod", "v1", "pods")
EVENT = Kind("Event", "v1", "events")
LEASE = Kind("Lease", "coordination.k8s.io/v1", "leases")
HORIZONTAL_POD_AUTOSCALER = Kind("HorizontalPodAutoscaler", "autoscaling/v2", "horizontalpodautoscalers")
SCALED_OBJECT = Kind("ScaledObject", "keda.sh/v1alpha1", "scaledobjects", crd="scaledobjects.keda.sh")
CRD = Kind("CustomResourceDefinition", "apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)

# What the operator writes for an InferenceService (the ConfigMap first: the pods mount it).
CHILDREN = (CONFIG_MAP, DEPLOYMENT, SERVICE, DISRUPTION_BUDGET, POD_MONITOR, PROMETHEUS_RULE, INFERENCE_POOL)
# What it watches besides the InferenceServices: every child (a deletion or an edit is put right) and the server
# pods (why they are not ready), all selected on the server by the operator's own label.
WATCHED = (*CHILDREN, POD)
# The other autoscalers whose scaleTargetRef may name a service or its Deployment (external_scalers.py): the
# user's objects, so watched whole in the namespaces served, not by the operator's label.
SCALERS = (HORIZONTAL_POD_AUTOSCALER, SCALED_OBJECT)
ALL = (INFERENCE_SERVICE, *WATCHED, *SCALERS, EVENT, LEASE, CRD)
# The CRDs followed: whether an optional child may be written, whether KEDA's ScaledObjects count.
OPTIONAL_CRDS = {kind.crd: kind for kind in (*CHILDREN, *SCALERS) if kind.crd}


def by_kind(kind: str, api_version: str | None = None) -> Kind:
    for known in ALL:
        if known.kind == kind and (api_version is None or known.api_version == api_version):
            return known
    raise ValueError(f"no REST path known for {kind} {api_version or ''}".rstrip())

"""Reading API objects in the operator's integration tests: an object or None, a condition by type, an object's
Events; CRDs of other projects reduced to an open schema; playing the kubelet for a held pod. `cluster` is the
tests' `cluster` fixture (kubectl on 127.0.0.1)."""
from __future__ import annotations

import json

import yaml

# A pod with this annotation is left alone by kwok's pod stages (localcluster/kwok-stages.yaml): the test writes
# its status as the kubelet would, and finishes its deletion.
HELD_BY_TEST = {"test.metronome.dev/kubelet": "test"}


def get_json(cluster, *args: str) -> dict | None:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr or "not found" in result.stderr:
            return None
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)


def condition(obj: dict, type_: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def events_for(cluster, namespace: str, name: str) -> list[dict]:
    items = cluster.kubectl_json(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
    )["items"]
    return items


def open_crd(group: str, kind: str, plural: str, version: str = "v1") -> str:
    """A CRD of another project (prometheus-operator's PodMonitor, ...) with its real names and an open schema."""
    return yaml.safe_dump({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {"group": group, "scope": "Namespaced",
                 "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower()},
                 "versions": [{"name": version, "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": {"type": "object",
                                                              "x-kubernetes-preserve-unknown-fields": True}}}]},
    })


def set_pod_status(cluster, namespace: str, pod: str, status: dict) -> None:
    """Write a pod's status as its kubelet would (a merge patch of the status subresource)."""
    cluster.kubectl("patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))


def release_held_pods(cluster, namespace: str) -> None:
    """Finish the deletion of the held pods in `namespace` (kwok does not): force, as a lost node's pods are."""
    cluster.kubectl("delete", "pods", "-n", namespace, "--all", "--force", "--grace-period=0", "--wait=false",
                    check=False)

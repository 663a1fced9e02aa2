"""Fake GPU nodes that kwok manages (each offers nvidia.com/gpu like a real 8-GPU host)."""

from __future__ import annotations

from dataclasses import dataclass

GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class FakeNodeSpec:
    name: str
    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    pods: str = "110"


def default_nodes(count: int = 2) -> list[FakeNodeSpec]:
    return [FakeNodeSpec(name=f"kwok-gpu-{index}") for index in range(count)]


def node_manifest(spec: FakeNodeSpec) -> dict:
    """A Node object for kwok: the annotation hands it to kwok; status.capacity is kept by kwok's stage."""
    resources = {"cpu": spec.cpu, "memory": spec.memory, "pods": spec.pods, GPU_RESOURCE: str(spec.gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": spec.name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": spec.name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
            },
        },
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def is_ready(node: dict) -> bool:
    conditions = node.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

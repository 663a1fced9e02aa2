"""Small helpers of the e2e tests: polling, Prometheus queries, the servers' /v1/config, the resource's columns.
Everything here talks to 127.0.0.0/8 only (the API server through kubectl, Prometheus, the stand-in's servers)."""
from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def prom_query(prometheus_url: str, promql: str) -> list[dict]:
    """An instant query's `data.result`."""
    body = get_json(f"{prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    if body.get("status") != "success":
        raise AssertionError(f"Prometheus refused {promql!r}: {body}")
    return body["data"]["result"]


def server_config(base_url: str) -> dict:
    """A server's /v1/config (generation and scheduler it applies)."""
    return get_json(f"{base_url}/v1/config")


def isvc_columns(cluster, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get inferenceservices.metronome.dev NAME` as {column: value}."""
    lines = cluster.kubectl("get", "inferenceservices.metronome.dev", name, "-n", namespace).stdout.splitlines()
    header, row = lines[0].split(), lines[1].split()
    return dict(zip(header, row))


def isvc(cluster, namespace: str, name: str) -> dict:
    return cluster.kubectl_json("get", "inferenceservices.metronome.dev", name, "-n", namespace)


def config_map_generation(cluster, namespace: str, name: str) -> int:
    import yaml

    config_map = cluster.kubectl_json("get", "configmap", f"{name}-config", "-n", namespace)
    return int(yaml.safe_load(config_map["data"]["server.yaml"])["generation"])

"""Reading API objects in the operator's integration tests: an object or None, a condition by type, an object's
Events. `cluster` is the tests' `cluster` fixture (kubectl on 127.0.0.1)."""
from __future__ import annotations

import json


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

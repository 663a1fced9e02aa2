"""hf:// and s3:// sources in the pod: an init container downloads the model into a cache volume, then the server
loads that copy. Pure builders (dicts in, dicts out), called by builders.pod_template.

The init container runs the server image's `metronome fetch-model` (server/models/fetch/) with the credentials
the spec names as secretKeyRefs (the kubelet resolves them: the operator never reads a Secret, and the server
container never sees them). The cache volume is the `model` volume: a ReadWriteMany claim shared by every replica
(spec.model.cache.claimName: downloaded once, kept across restarts and rollouts; a second pod finds the complete
copy and skips the download) or an emptyDir per pod. The server gets the same URI as --model and the same cache
root: the loader finds the complete copy and never touches the network.
"""
from __future__ import annotations

from typing import Any

from metronome.contract.remote_source import CACHE_ENV
from metronome.operator.spec import ModelSpec, SecretKey

REMOTE_KINDS = ("hf", "s3")
FETCH_CONTAINER = "fetch-model"


def is_remote(model: ModelSpec) -> bool:
    return model.source.kind in REMOTE_KINDS


def cache_volume(model: ModelSpec) -> dict[str, Any]:
    """The `model` volume for a remote source."""
    if model.cache.claim_name:
        return {"name": "model", "persistentVolumeClaim": {"claimName": model.cache.claim_name}}
    empty_dir = {"sizeLimit": model.cache.size_limit} if model.cache.size_limit else {}
    return {"name": "model", "emptyDir": empty_dir}


def _secret_env(name: str, ref: SecretKey) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def fetch_env(model: ModelSpec) -> list[dict[str, Any]]:
    """What `metronome fetch-model` reads: huggingface_hub's and boto3's own variables."""
    env: list[dict[str, Any]] = []
    if model.source.kind == "hf":
        if model.token_secret is not None:
            env.append(_secret_env("HF_TOKEN", model.token_secret))
        if model.hf_endpoint:
            env.append({"name": "HF_ENDPOINT", "value": model.hf_endpoint})
    else:
        s3 = model.s3
        if s3.endpoint:
            env.append({"name": "AWS_ENDPOINT_URL_S3", "value": s3.endpoint})
        if s3.region:
            env.append({"name": "AWS_REGION", "value": s3.region})
        if s3.credentials_secret:
            env.append(_secret_env("AWS_ACCESS_KEY_ID", SecretKey(s3.credentials_secret, s3.access_key_id_key)))
            env.append(_secret_env("AWS_SECRET_ACCESS_KEY",
                                   SecretKey(s3.credentials_secret, s3.secret_access_key_key)))
    return env


def fetch_args(model: ModelSpec, cache_dir: str) -> list[str]:
    """`metronome fetch-model` arguments (a unit test parses them with that command's own parser)."""
    return ["fetch-model", model.source.value, "--cache-dir", cache_dir]


def fetch_init_container(model: ModelSpec, server: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    """The init container, derived from the server container: same image, pull policy, security context and
    writable /tmp; the server's CPU and memory without its GPUs (an init container's requests do not add to the
    pod's, so this costs no extra room on the node); the cache volume mounted writable."""
    resources = {kind: {k: v for k, v in values.items() if k in ("cpu", "memory")}
                 for kind, values in server["resources"].items()}
    mounts = [{"name": "model", "mountPath": cache_dir}]
    mounts += [m for m in server["volumeMounts"] if m["name"] == "tmp"]
    base_env = [e for e in server["env"] if e["name"] in ("HOME", "XDG_CACHE_HOME", "HF_HOME")]
    return {
        "name": FETCH_CONTAINER,
        "image": server["image"],
        "imagePullPolicy": server["imagePullPolicy"],
        "command": ["metronome"],
        "args": fetch_args(model, cache_dir),
        "env": base_env + fetch_env(model),
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": server["securityContext"],
        # A failed download says why in the pod's status (and so in Ready): the end of its log.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def server_cache_env(cache_dir: str) -> dict[str, str]:
    return {"name": CACHE_ENV, "value": cache_dir}

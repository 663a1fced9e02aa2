"""The pod the operator builds for an s3:// source, played on this machine: its init container's command and
environment (secretKeyRefs resolved from a Secret, mount paths mapped to local folders) download from a real S3
server (versitygw on 127.0.0.1); the S3 server is then stopped, and the server container's command loads the
cached copy and answers a completion — the hand-off between the two containers, without the network."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from metronome.contract.config import next_server_config
from metronome.operator import builders
from metronome.operator.spec import parse_service
from metronome.server.bench.processes import free_port
from metronome.server.models.default_model import default_model_path
from metronome_testing.polling import wait_for
from metronome_testing.s3_server import start_s3_server
from metronome_testing.standin.podspec import LocalMounts, local_argv, server_pod
from metronome_testing.standin.server_process import ServerProcess

METRONOME = str(Path(sys.executable).parent / "metronome")


def resolve_env(env: list[dict], secrets: dict[str, dict[str, str]], mounts: LocalMounts,
                pod_name: str = "smol-0") -> dict[str, str]:
    """What the kubelet hands the container: values (paths mapped to the local volumes), secretKeyRefs and the
    pod's name."""
    out = {}
    for item in env:
        source = item.get("valueFrom", {})
        if "value" in item:
            out[item["name"]] = mounts.translate(item["value"])
        elif "secretKeyRef" in source:
            out[item["name"]] = secrets[source["secretKeyRef"]["name"]][source["secretKeyRef"]["key"]]
        else:
            assert source == {"fieldRef": {"fieldPath": "metadata.name"}}, item
            out[item["name"]] = pod_name
    return out


def test_the_init_container_fills_the_cache_the_server_then_loads_offline(tmp_path):
    s3 = start_s3_server(tmp_path / "s3")
    try:
        s3.client().create_bucket(Bucket="models")
        s3.client().upload_file(str(default_model_path()), "models", "smollm2/model.gguf")
        body = {"apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "smol", "namespace": "ml", "uid": "u1", "generation": 1},
                "spec": {"model": {"source": "s3://models/smollm2", "s3": {"endpoint": s3.endpoint,
                                   "credentialsSecret": {"name": "s3-creds"}}},
                         "resources": {"gpus": 0}}}
        service = parse_service(body)
        template = builders.deployment(service)["spec"]["template"]
        pod = {"metadata": {"namespace": "ml", "name": "smol-0", "uid": "p1", **template["metadata"]},
               "spec": template["spec"]}
        config = tmp_path / "config"
        config.mkdir()
        config_map = builders.config_map(service, next_server_config(None, service.spec.server))
        (config / "server.yaml").write_text(config_map["data"]["server.yaml"])
        mounts = LocalMounts((("/models", str(tmp_path / "cache")), ("/tmp", str(tmp_path / "scratch")),
                              ("/etc/metronome", str(config))))
        for local in ("cache", "scratch"):
            (tmp_path / local).mkdir()
        secrets = {"s3-creds": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}}
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "METRONOME_MODEL"))}

        (init,) = template["spec"]["initContainers"]
        argv = [METRONOME, *(mounts.translate(a) for a in init["args"])]
        fetched = subprocess.run(
            argv, capture_output=True, text=True, timeout=300,
            env={**clean, **resolve_env(init["env"], secrets, mounts)})
        assert fetched.returncode == 0, fetched.stderr
        assert Path(fetched.stdout.strip()).parent == tmp_path / "cache" / "s3"
    finally:
        s3.stop()  # from here on, the bucket is unreachable

    (server,) = template["spec"]["containers"]
    port = free_port()
    process = ServerProcess(local_argv(server_pod(pod), [METRONOME], "127.0.0.1", port, "cpu", mounts,
                                       ("--num-kv-blocks", "64")),
                            "127.0.0.1", port, tmp_path / "server.log",
                            env={**resolve_env(server["env"], {}, mounts)})
    process.start()
    try:
        wait_for(lambda: process.exit_code() is None and process.is_ready() or process.exit_code() is not None,
                 "the server to be ready", timeout=300)
        assert process.exit_code() is None, process.log_tail()
        request = urllib.request.Request(f"{process.base_url}/v1/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "smol", "prompt": "The capital of France is",
                                                          "max_tokens": 4, "temperature": 0}).encode())
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["text"]
    finally:
        process.stop(grace_s=10)

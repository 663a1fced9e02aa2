"""spec.model with hf:// and s3:// sources: the parsed spec, the init container that downloads into the cache
volume, and the server container that loads the cached copy (pure builders; the download itself is tested in
tests/unit/test_fetch_hub.py and tests/integration/test_fetch_s3.py)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from metronome.operator import builders
from metronome.operator.spec import ModelCacheSpec, S3Spec, SecretKey, SpecError, parse_service, parse_source

CRD = Path(__file__).resolve().parents[2] / "crds" / "inferenceservice.yaml"


def service_of(model: dict, **spec):
    body = {"apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 1},
            "spec": {"model": model, **spec}}
    return parse_service(body)


def pod_of(model: dict, **spec) -> dict:
    return builders.deployment(service_of(model, **spec))["spec"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


HF = {"source": "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f", "tokenSecret": {"name": "hf-token"},
      "hfEndpoint": "https://hf-mirror.example.com", "cache": {"claimName": "model-cache"}}
S3 = {"source": "s3://models/llama-3-8b", "s3": {"endpoint": "http://minio.storage:9000", "region": "eu-west-1",
                                                 "credentialsSecret": {"name": "s3-creds"}},
      "cache": {"sizeLimit": "40Gi"}}


def test_an_hf_source_parses_with_its_token_mirror_and_shared_cache():
    model = service_of(HF).spec.model
    assert (model.source.kind, model.source.value) == ("hf", "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f")
    assert model.token_secret == SecretKey("hf-token", "HF_TOKEN")  # the CRD's default key
    assert model.hf_endpoint == "https://hf-mirror.example.com"
    assert model.cache == ModelCacheSpec(claim_name="model-cache")


def test_the_init_container_downloads_into_the_shared_claim_the_server_reads():
    pod = pod_of(HF, resources={"gpus": 1, "cpu": "4", "memory": "32Gi"})
    (init,) = pod["initContainers"]
    (server,) = pod["containers"]
    assert init["name"] == "fetch-model" and init["image"] == server["image"] and init["command"] == ["metronome"]
    assert init["args"] == ["fetch-model", "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f", "--cache-dir", "/models"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume == {"name": "model", "persistentVolumeClaim": {"claimName": "model-cache"}}  # writable
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]
    assert server["args"][server["args"].index("--model") + 1] == "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f"
    assert env_of(server)["METRONOME_MODEL_CACHE"] == "/models"
    init_env = env_of(init)
    assert init_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    assert init_env["HF_ENDPOINT"] == "https://hf-mirror.example.com" and init_env["HOME"] == "/tmp"
    assert "HF_TOKEN" not in env_of(server)  # the secret stays with the downloader
    assert init["resources"] == {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "32Gi"}}
    assert init["securityContext"] == server["securityContext"]
    assert {"name": "tmp", "mountPath": "/tmp"} in init["volumeMounts"]  # the root filesystem is read-only


def test_an_s3_source_gets_its_endpoint_region_and_key_pair_in_a_sized_emptydir():
    model = service_of(S3).spec.model
    assert model.s3 == S3Spec("http://minio.storage:9000", "eu-west-1", "s3-creds")
    pod = pod_of(S3)
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume == {"name": "model", "emptyDir": {"sizeLimit": "40Gi"}}
    init_env = env_of(pod["initContainers"][0])
    assert init_env["AWS_ENDPOINT_URL_S3"] == "http://minio.storage:9000" and init_env["AWS_REGION"] == "eu-west-1"
    assert init_env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}}
    assert init_env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert not any(k.startswith("AWS_") for k in env_of(pod["containers"][0]))


def test_the_pods_own_identity_and_custom_secret_keys():
    bare = pod_of({"source": "s3://models/x"})
    assert [e["name"] for e in bare["initContainers"][0]["env"]] == ["HOME", "XDG_CACHE_HOME", "HF_HOME"]
    assert next(v for v in bare["volumes"] if v["name"] == "model") == {"name": "model", "emptyDir": {}}
    custom = pod_of({"source": "s3://models/x", "s3": {"credentialsSecret": {
        "name": "c", "accessKeyIdKey": "id", "secretAccessKeyKey": "secret"}}})
    env = env_of(custom["initContainers"][0])
    assert env["AWS_ACCESS_KEY_ID"]["secretKeyRef"] == {"name": "c", "key": "id"}
    assert env["AWS_SECRET_ACCESS_KEY"]["secretKeyRef"] == {"name": "c", "key": "secret"}


@pytest.mark.parametrize("model", [{"source": "default"}, {"source": "pvc:weights/llama"}, {"source": "random:tiny"}])
def test_local_sources_have_no_init_container(model):
    pod = pod_of(model)
    assert "initContainers" not in pod
    assert "METRONOME_MODEL_CACHE" not in env_of(pod["containers"][0])


def test_the_commands_own_parsers_take_what_the_operator_writes():
    from metronome.server.api import serve_cli
    from metronome.server.models.fetch import cli as fetch_cli

    pod = pod_of(HF)
    fetch_parser = argparse.ArgumentParser()
    fetch_cli.configure(fetch_parser)
    fetched = fetch_parser.parse_args(pod["initContainers"][0]["args"][1:])
    assert (fetched.source, fetched.cache_dir) == (HF["source"], "/models")
    serve_parser = argparse.ArgumentParser()
    serve_cli.configure(serve_parser)
    assert serve_parser.parse_args(pod["containers"][0]["args"][1:]).model == HF["source"]


@pytest.mark.parametrize("model, message", [
    ({"source": "s3://models/x", "tokenSecret": {"name": "t"}}, r"spec\.model\.tokenSecret: only for hf://"),
    ({"source": "hf://o/n", "s3": {"endpoint": "http://x"}}, r"spec\.model\.s3: only for s3://"),
    ({"source": "default", "cache": {"claimName": "c"}}, r"spec\.model\.cache: only for hf:// and s3://"),
    ({"source": "pvc:w", "hfEndpoint": "https://m"}, r"spec\.model\.hfEndpoint: only for hf://"),
    ({"source": "hf://o/n", "hfEndpoint": "mirror.example.com"}, r"spec\.model\.hfEndpoint: expected an http"),
    ({"source": "hf://o/n", "tokenSecret": {"key": "k"}}, r"spec\.model\.tokenSecret\.name: required"),
    ({"source": "s3://b-1/x", "s3": {"credentialsSecret": {}}}, r"spec\.model\.s3\.credentialsSecret\.name"),
    ({"source": "s3://b-1/x", "cache": {"claimName": "c", "sizeLimit": "1Gi"}}, r"spec\.model\.cache\.sizeLimit"),
    ({"source": "hf://justaname"}, r"spec\.model\.source: .*org/name"),
    ({"source": "s3://Bad_Bucket"}, r"spec\.model\.source: .*bucket"),
])
def test_misplaced_or_bad_fields_are_spec_errors_naming_the_field(model, message):
    with pytest.raises(SpecError, match=message):
        service_of(model)


@pytest.mark.parametrize("source, accepted", [
    ("hf://meta-llama/Llama-3.1-8B-Instruct", True), ("hf://o/n@refs/pr/1", True), ("hf://o/n/q/m.Q8_0.gguf@v1", True),
    ("s3://models", True), ("s3://models/team/llama-3/", True), ("hf://justaname", False), ("hf://o/n@", False),
    ("s3://Bad_Bucket/x", False), ("s3://ab", False), ("gs://bucket/x", False),
])
def test_the_crd_pattern_and_the_parser_agree_on_remote_sources(source, accepted):
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pattern = schema["properties"]["spec"]["properties"]["model"]["properties"]["source"]["pattern"]
    assert bool(re.fullmatch(pattern, source)) == accepted
    if accepted:
        parse_source(source)
    else:
        with pytest.raises(SpecError):
            parse_source(source)

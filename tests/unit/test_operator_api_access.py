"""spec.model.servedNames and spec.apiKeySecret: parsed, refused when malformed, and written into the server pod
as `metronome serve` reads them (its own parser checks the command line)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from metronome.operator import builders
from metronome.operator.spec import SpecError, parse_service

CRD = Path(__file__).resolve().parents[2] / "crds" / "inferenceservice.yaml"


def service_of(**spec_overrides):
    spec = {"model": {"source": "default"}, **spec_overrides}
    return parse_service({"apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService",
                          "metadata": {"name": "chat", "namespace": "ml", "uid": "u", "generation": 1}, "spec": spec})


def server_container(service) -> dict:
    (container,) = builders.deployment(service)["spec"]["template"]["spec"]["containers"]
    return container


def serve_args(service) -> argparse.Namespace:
    from metronome.server.api import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.configure(parser)
    return parser.parse_args(server_container(service)["args"][1:])


def test_served_names_follow_the_service_name():
    service = service_of(model={"source": "default", "servedNames": ["meta-llama/Llama-3.1-8B-Instruct", "gpt-4o"]})
    assert service.spec.model.served_names == ("meta-llama/Llama-3.1-8B-Instruct", "gpt-4o")
    assert serve_args(service).served_model_name == ["chat", "meta-llama/Llama-3.1-8B-Instruct", "gpt-4o"]
    assert serve_args(service_of()).served_model_name == ["chat"]  # metrics keep the service's name first
    repeated = service_of(model={"source": "default", "servedNames": ["chat", "x"]})
    assert serve_args(repeated).served_model_name == ["chat", "x"]


@pytest.mark.parametrize("names, problem", [("gpt-4o", "list"), ([""], "name"), (["a b"], "name"), ([7], "name")])
def test_bad_served_names_name_the_field(names, problem):
    with pytest.raises(SpecError, match=r"spec\.model\.servedNames"):
        service_of(model={"source": "default", "servedNames": names})


def test_the_api_key_comes_from_the_secret_as_an_environment_variable():
    service = service_of(apiKeySecret={"name": "chat-keys"})
    env = {e["name"]: e for e in server_container(service)["env"]}
    assert env["METRONOME_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "chat-keys", "key": "api-key"}}
    custom = service_of(apiKeySecret={"name": "keys", "key": "token"})
    env = {e["name"]: e for e in server_container(custom)["env"]}
    assert env["METRONOME_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "token"}
    assert "METRONOME_API_KEY" not in {e["name"] for e in server_container(service_of())["env"]}
    # the probes stay open: the server never asks /health or /ready for a key (server/api/auth.py)
    from metronome.server.api.auth import OPEN_PATHS

    probes = server_container(service)
    assert {probes["readinessProbe"]["httpGet"]["path"], probes["livenessProbe"]["httpGet"]["path"]} <= OPEN_PATHS


@pytest.mark.parametrize("secret", [{}, {"name": "Bad_Name"}, {"name": "ok", "key": "a/b"}, "keys"])
def test_bad_api_key_secrets_name_the_field(secret):
    with pytest.raises(SpecError, match=r"spec\.apiKeySecret"):
        service_of(apiKeySecret=secret)


def test_the_crd_declares_both_fields():
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]["properties"]
    names = spec["model"]["properties"]["servedNames"]
    assert names["type"] == "array" and names["items"]["type"] == "string" and names["description"]
    secret = spec["apiKeySecret"]
    assert secret["required"] == ["name"] and secret["properties"]["key"]["default"] == "api-key"

"""A child the API server refused, told in the resource's terms (operator/refusals.py): the child's field path
mapped onto the spec field it comes from, list items named, the API server's words kept."""
from __future__ import annotations

import pytest

from metronome.operator import builders
from metronome.operator.refusals import explain, spec_field
from metronome.operator.spec import parse_service


def deployment(**spec) -> dict:
    sidecar = {"name": "exporter", "image": "busybox", "ports": [{"name": "Web_Port", "containerPort": 9100}]}
    spec.setdefault("podTemplate", {"spec": {"containers": [{"name": "server", "env": [{"name": "A=B"}]}, sidecar],
                                             "volumes": [{"name": "scratch", "emptyDir": {}}]}})
    body = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u", "generation": 1},
            "spec": {"model": {"source": "hf://acme/model"}, **spec}}
    return builders.deployment(parse_service(body))


@pytest.mark.parametrize(("path", "expected"), [
    ("spec.template.spec.tolerations[0].value", "spec.resources.tolerations[0].value"),
    ("spec.template.spec.nodeSelector", "spec.resources.nodeSelector"),
    ("spec.template.spec.containers[0].resources.requests[cpu]", "spec.resources"),
    ("spec.template.spec.containers[0].image", "spec.image"),
    ("spec.template.spec.containers[1].ports[0].name",
     "spec.podTemplate.spec.containers[exporter].ports[Web_Port].name"),
    ("spec.template.spec.affinity.nodeAffinity", "spec.podTemplate.spec.affinity.nodeAffinity"),
    ("spec.template.metadata.labels", "spec.podTemplate.metadata.labels"),
    ("spec.template.spec.volumes[3].emptyDir.sizeLimit", "spec.resources.shmSize"),
    ("spec.template.spec.volumes[4].configMap", "spec.podTemplate.spec.volumes[scratch].configMap"),
    ("spec.replicas", "spec.replicas"),
    ("spec.template.spec.initContainers[0].args",
     "spec.model (its download container: initContainers[fetch-model].args)"),
])
def test_a_childs_field_is_named_as_the_spec_field_it_comes_from(path, expected):
    assert spec_field("Deployment", path, deployment()) == expected


def test_the_server_containers_env_is_named_by_variable():
    child = deployment()
    index = next(i for i, e in enumerate(child["spec"]["template"]["spec"]["containers"][0]["env"])
                 if e["name"] == "A=B")
    field = spec_field("Deployment", f"spec.template.spec.containers[0].env[{index}].name", child)
    assert field == "spec.podTemplate.spec.containers[server].env[A=B].name"


def test_the_message_keeps_the_api_servers_words_and_the_childs_path():
    details = {"causes": [{"field": "spec.template.spec.containers[1].ports[0].name",
                           "message": 'Invalid value: "Web_Port": must contain only alpha-numeric characters'}]}
    refusal = explain("Deployment", "chat", 422, "Deployment.apps \"chat\" is invalid", details, deployment())
    assert refusal.reason == "SpecRejected" and refusal.message.startswith("the API server refused it: ")
    assert "spec.podTemplate.spec.containers[exporter].ports[Web_Port].name: Invalid value" in refusal.message
    assert "(Deployment field spec.template.spec.containers[1].ports[0].name)" in refusal.message
    plain = explain("Deployment", "chat", 403, "admission webhook \"policy\" denied the request", None, {})
    assert plain.message == 'the API server refused it: Deployment chat: admission webhook "policy" denied the request'

"""The server image of an InferenceService without spec.image is the operator's --server-image (parse_service's
`default_image`), which the pod template runs; spec.image always wins. The flag itself: test_operator_cli.py."""
from __future__ import annotations

from metronome.operator import builders
from metronome.operator.spec import DEFAULT_IMAGE, parse_service

LOCAL = "localhost/metronome-server:latest"


def body(**spec) -> dict:
    return {"metadata": {"name": "chat", "namespace": "ml", "uid": "u"},
            "spec": {"model": {"source": "default"}, **spec}}


def test_a_service_without_spec_image_runs_the_operators_image():
    (container,) = builders.pod_template(parse_service(body(), LOCAL))["spec"]["containers"]
    assert container["image"] == LOCAL
    assert parse_service(body()).spec.image == DEFAULT_IMAGE  # no operator setting: the built-in default


def test_spec_image_wins_over_the_operators_image():
    chosen = parse_service(body(image="registry.example/metronome-server:9"), LOCAL)
    assert chosen.spec.image == "registry.example/metronome-server:9"

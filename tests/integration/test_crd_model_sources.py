"""The API server enforces spec.model's download fields (pattern, defaults, CEL cross-field rules): server-side
dry runs against the real control plane, nothing stored, no operator needed."""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from metronome_testing.chart import ensure_crd
from metronome_testing.checkout import EXAMPLE, ROOT

VALID = yaml.safe_load(EXAMPLE.read_text())


@pytest.fixture(scope="module")
def ns(cluster):
    ensure_crd(cluster)
    return cluster.namespace("crd-models")


def with_model(model: dict) -> dict:
    obj = copy.deepcopy(VALID)
    obj["spec"]["model"] = model
    return obj


def dry_run(cluster, ns: str, obj: dict):
    return cluster.kubectl("create", "--dry-run=server", "-n", ns, "-o", "json", "-f", "-",
                           input=json.dumps(obj), check=False)


def test_remote_sources_are_accepted_and_defaulted(cluster, ns):
    hf = dry_run(cluster, ns, with_model({"source": "hf://meta-llama/Llama-3.1-8B-Instruct@main",
                                          "tokenSecret": {"name": "hf"}, "hfEndpoint": "https://mirror.example",
                                          "cache": {"claimName": "models"}}))
    assert hf.returncode == 0, hf.stderr
    assert json.loads(hf.stdout)["spec"]["model"]["tokenSecret"] == {"name": "hf", "key": "HF_TOKEN"}
    s3 = dry_run(cluster, ns, with_model({"source": "s3://models/llama/", "cache": {"sizeLimit": "40Gi"},
                                          "s3": {"endpoint": "http://minio:9000", "credentialsSecret": {"name": "c"}}}))
    assert s3.returncode == 0, s3.stderr
    assert json.loads(s3.stdout)["spec"]["model"]["s3"]["credentialsSecret"] == {
        "name": "c", "accessKeyIdKey": "AWS_ACCESS_KEY_ID", "secretAccessKeyKey": "AWS_SECRET_ACCESS_KEY"}


def test_the_hf_example_is_accepted(cluster, ns):
    obj = yaml.safe_load((ROOT / "examples" / "hf-model.yaml").read_text())
    result = dry_run(cluster, ns, obj)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["spec"]["model"]["tokenSecret"]["key"] == "HF_TOKEN"


INVALID = [
    ("hf-without-name", {"source": "hf://justaname"}, "spec.model.source"),
    ("s3-bad-bucket", {"source": "s3://Bad_Bucket/x"}, "spec.model.source"),
    ("token-on-s3", {"source": "s3://models/x", "tokenSecret": {"name": "t"}},
     "spec.model.tokenSecret is only for hf:// sources"),
    ("s3-on-hf", {"source": "hf://o/n", "s3": {"endpoint": "http://x"}}, "spec.model.s3 is only for s3:// sources"),
    ("endpoint-on-pvc", {"source": "pvc:w", "hfEndpoint": "https://m"}, "spec.model.hfEndpoint is only for hf://"),
    ("cache-on-default", {"source": "default", "cache": {"claimName": "c"}}, "spec.model.cache is only for hf://"),
    ("claim-and-size", {"source": "hf://o/n", "cache": {"claimName": "c", "sizeLimit": "1Gi"}},
     "spec.model.cache.sizeLimit is for the emptyDir cache"),
    ("endpoint-not-a-url", {"source": "hf://o/n", "hfEndpoint": "mirror.example"}, "spec.model.hfEndpoint"),
    ("token-without-name", {"source": "hf://o/n", "tokenSecret": {"key": "k"}}, "spec.model.tokenSecret.name"),
]


@pytest.mark.parametrize(("model", "expected"), [(m, e) for _, m, e in INVALID], ids=[i for i, _, _ in INVALID])
def test_misplaced_download_fields_are_rejected_naming_the_field(cluster, ns, model, expected):
    result = dry_run(cluster, ns, with_model(model))
    assert result.returncode != 0, f"accepted: {json.dumps(model)}"
    assert expected in result.stderr, result.stderr

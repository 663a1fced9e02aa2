"""The API server itself enforces the CRD: invalid InferenceServices are rejected with a message naming the field;
valid ones are accepted and defaulted. Server-side dry runs: nothing is stored, no operator needed."""
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
    return cluster.namespace("crd")


def _with(path: str, value, base: dict = VALID) -> dict:
    obj = copy.deepcopy(base)
    node = obj
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return obj


_DELETE = object()


def _dry_run(cluster, ns: str, obj: dict):
    return cluster.kubectl("create", "--dry-run=server", "-n", ns, "-o", "json", "-f", "-",
                           input=json.dumps(obj), check=False)


INVALID = [
    # (id, object, text the API server's message must contain)
    ("replicas-wrong-type", _with("spec.replicas", "two"), "spec.replicas"),
    ("gpus-out-of-range", _with("spec.resources.gpus", 32), "spec.resources.gpus"),
    ("unknown-queue-policy", _with("spec.server.queuePolicy", "lifo"), "spec.server.queuePolicy"),
    ("unknown-autotune-policy", _with("spec.autotune.policy", "pid"), "spec.autotune.policy"),
    ("unknown-dtype", _with("spec.model.dtype", "int8"), "spec.model.dtype"),
    ("chunk-size-zero", _with("spec.server.chunkSize", 0), "spec.server.chunkSize"),
    ("tbt-slo-zero", _with("spec.slo.tbtP99Ms", 0), "spec.slo.tbtP99Ms"),
    ("tbt-slo-negative", _with("spec.slo.tbtP99Ms", -5), "spec.slo.tbtP99Ms"),
    ("bad-model-source", _with("spec.model.source", "gs://bucket/llama"), "spec.model.source"),
    ("model-missing", _with("spec.model", _DELETE), "spec.model"),
    ("bad-memory-quantity", _with("spec.resources.memory", "lots"), "spec.resources.memory"),
    ("bad-block-size", _with("spec.engine.blockSize", 100), "spec.engine.blockSize"),
    ("bad-prometheus-url", _with("spec.metrics.prometheusUrl", "prometheus:9090"), "spec.metrics.prometheusUrl"),
    ("misplaced-field", _with("spec.chunkSize", 256), "spec.chunkSize"),
    # cross-field rules (CEL)
    ("min-chunk-above-max", _with("spec.autotune.maxChunkSize", 32),
     "spec.autotune.minChunkSize must be <= spec.autotune.maxChunkSize"),
    ("replicas-above-max", _with("spec.replicas", 9), "spec.replicas must be <= spec.maxReplicas"),
    ("replicas-below-min", _with("spec.minReplicas", 3), "spec.replicas must be >= spec.minReplicas"),
    ("min-above-max-replicas", _with("spec.minReplicas", 3, _with("spec.maxReplicas", 2, _with("spec.replicas", 2))),
     "spec.minReplicas must be <= spec.maxReplicas"),
    ("autotune-without-slo", _with("spec.slo", _DELETE), "spec.slo is required when spec.autotune.mode"),
    ("batched-tokens-below-seqs", _with("spec.server.maxNumBatchedTokens", 16),
     "spec.server.maxNumBatchedTokens must be >= spec.server.maxNumSeqs"),
    ("short-chunk-below-threshold", _with("spec.server.shortChunkSize", 256),
     "spec.server.shortChunkSize must be >= spec.server.shortPromptThreshold"),
    ("name-not-a-dns-label", _with("metadata.name", "smol.lm2"), "metadata.name"),
    ("token-burst-without-rate", _with("spec.engine.promptTokenBurstPerClient", 4000),
     "spec.engine.promptTokenBurstPerClient needs maxPromptTokensPerSecondPerClient"),
    ("extra-args-repeat-token-rate", _with("spec.engine.extraArgs", ["--max-prompt-tokens-per-second-per-client=9"]),
     "spec.engine.extraArgs may not repeat"),
    ("unknown-quantization", _with("spec.model.quantization", "int4"), "spec.model.quantization"),
    ("unknown-kv-cache-dtype", _with("spec.engine.kvCacheDtype", "fp16"), "spec.engine.kvCacheDtype"),
    ("extra-args-repeat-kv-dtype", _with("spec.engine.extraArgs", ["--kv-cache-dtype", "fp8"]),
     "spec.engine.extraArgs may not repeat"),
    # What the Deployment API would refuse, refused here already (Kubernetes' own rules, mirrored)
    ("toleration-exists-with-value", _with("spec.resources.tolerations", [
        {"key": "nvidia.com/gpu", "operator": "Exists", "value": "present"}]),
     "spec.resources.tolerations[0].value"),
    ("toleration-without-key-not-exists", _with("spec.resources.tolerations", [{"operator": "Equal", "value": "a"}]),
     "operator must be Exists when key is empty"),
    ("toleration-seconds-without-noexecute", _with("spec.resources.tolerations", [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}]),
     "effect must be NoExecute when tolerationSeconds is set"),
    ("toleration-bad-key", _with("spec.resources.tolerations", [{"key": "gpu type", "operator": "Exists"}]),
     "spec.resources.tolerations[0].key"),
    ("toleration-bad-value", _with("spec.resources.tolerations", [{"key": "gpu", "value": "a b"}]),
     "spec.resources.tolerations[0].value"),
    ("negative-cpu", _with("spec.resources.cpu", "-1"), "spec.resources.cpu"),
    ("negative-shm", _with("spec.resources.shmSize", "-1Gi"), "spec.resources.shmSize"),
    ("node-selector-bad-key", _with("spec.resources.nodeSelector", {"gpu type": "a100"}),
     "spec.resources.nodeSelector keys must be label keys"),
    ("node-selector-bad-value", _with("spec.resources.nodeSelector", {"gpu": "a 100"}),
     "spec.resources.nodeSelector"),
    ("pod-label-bad-key", _with("spec.podTemplate", {"metadata": {"labels": {"team name": "ml"}}}),
     "spec.podTemplate.metadata.labels keys must be label keys"),
    ("spread-selector-bad-key", _with("spec.podTemplate", {"spec": {"topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule",
         "labelSelector": {"matchLabels": {"app name": "x"}}}]}}), "matchLabels keys must be label keys"),
    ("affinity-bad-key", _with("spec.podTemplate", {"spec": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu type", "operator": "Exists"}]}]}}}}}), "matchExpressions[0].key"),
    ("topology-key-bad", _with("spec.podTemplate", {"spec": {"topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "zone name", "whenUnsatisfiable": "DoNotSchedule"}]}}), "topologyKey"),
    ("sidecar-negative-request", _with("spec.podTemplate", {"spec": {"containers": [
        {"name": "exporter", "image": "busybox", "resources": {"requests": {"cpu": "-100m"}}}]}}), "requests"),
]


@pytest.mark.parametrize(("obj", "expected"), [(o, e) for _, o, e in INVALID], ids=[i for i, _, _ in INVALID])
def test_invalid_objects_are_rejected_naming_the_field(cluster, ns, obj, expected):
    result = _dry_run(cluster, ns, obj)
    assert result.returncode != 0, f"accepted: {json.dumps(obj)}"
    assert expected in result.stderr, result.stderr


@pytest.mark.parametrize("path", ["examples/inferenceservice.yaml", "examples/llama-3-8b.yaml",
                                  "examples/llama-3-8b-fp8.yaml"])
def test_examples_are_accepted(cluster, ns, path):
    obj = yaml.safe_load((ROOT / path).read_text())
    result = _dry_run(cluster, ns, obj)
    assert result.returncode == 0, result.stderr


def test_what_kubernetes_accepts_stays_accepted(cluster, ns):
    obj = _with("spec.resources", {
        "cpu": "+500m", "memory": "1.5Gi", "shmSize": "2e9",
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200", "pool": ""},
        "tolerations": [{"operator": "Exists"}, {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "dedicated", "value": "ml", "effect": "NoExecute", "tolerationSeconds": 60}]})
    result = _dry_run(cluster, ns, obj)
    assert result.returncode == 0, result.stderr


def test_defaults_are_filled_in(cluster, ns):
    minimal = {
        "apiVersion": "metronome.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "minimal"},
        "spec": {"model": {"source": "random:tiny"}},
    }
    result = _dry_run(cluster, ns, minimal)
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["spec"]
    assert spec["replicas"] == 1 and spec["resources"]["gpus"] == 1 and spec["model"]["dtype"] == "auto"
    assert spec["server"]["chunkSize"] == 512 and spec["server"]["queuePolicy"] == "split"
    assert spec["autotune"]["mode"] == "off" and spec["metrics"]["windowSeconds"] == 60
    assert spec["engine"]["kvCacheDtype"] == "auto" and "quantization" not in spec["model"]


def test_fp8_fields_are_accepted(cluster, ns):
    obj = _with("spec.model.quantization", "fp8", _with("spec.engine.kvCacheDtype", "fp8"))
    result = _dry_run(cluster, ns, obj)
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["spec"]
    assert (spec["model"]["quantization"], spec["engine"]["kvCacheDtype"]) == ("fp8", "fp8")


def test_kubectl_explain_reads_the_descriptions(cluster, ns):
    out = cluster.kubectl("explain", "inferenceservices.metronome.dev.spec.autotune.mode").stdout
    assert "advise" in out and "apply" in out

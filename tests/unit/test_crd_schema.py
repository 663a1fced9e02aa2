"""The CRD file (the one source; the chart links to it, tests/unit/test_chart_files.py): well-formed, documented,
and in step with the operator's spec parser, the shared model-source syntax and the server's scheduler schema."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from metronome.contract.config import QueuePolicy, SchedulerConfig
from metronome.operator.spec import (
    AUTOTUNE_FIELDS,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    SpecError,
    parse_source,
    parse_spec,
)
from metronome.operator.tuning.settings import AutotuneSpec

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservice.yaml"


@pytest.fixture(scope="module")
def crd() -> dict:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="module")
def version(crd) -> dict:
    (only,) = crd["spec"]["versions"]
    return only


@pytest.fixture(scope="module")
def schema(version) -> dict:
    return version["schema"]["openAPIV3Schema"]


def test_names(crd, version):
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], names["kind"], names["plural"], version["name"]) == (GROUP, KIND, PLURAL, VERSION)
    assert names["shortNames"] and "isvc" not in names["shortNames"]  # KServe's
    assert version["served"] and version["storage"]


def test_subresources(version):
    sub = version["subresources"]
    assert sub["status"] == {}
    assert sub["scale"]["specReplicasPath"] == ".spec.replicas"
    assert sub["scale"]["statusReplicasPath"] == ".status.replicas"


def _walk(node: dict, path: str = ""):
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{key}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_every_field_is_described(schema):
    # The API server forbids anything but type under metadata.
    missing = [p or "<root>" for p, node in _walk(schema) if not node.get("description") and p != ".metadata"]
    assert missing == []


def test_structural_every_field_has_a_type(schema):
    untyped = [p for p, node in _walk(schema) if "type" not in node and not node.get("x-kubernetes-int-or-string")]
    assert untyped == []


def test_printer_columns_point_at_status_fields(version, schema):
    columns = {c["name"].upper(): c for c in version["additionalPrinterColumns"] if c.get("priority", 0) == 0}
    assert list(columns) == ["READY", "CHUNK", "POLICY", "TBT-P99", "SLO", "TOK/S", "EXPERIMENT", "AGE"]
    status_props = schema["properties"]["status"]["properties"]
    for name, column in columns.items():
        if name == "AGE":
            assert column["jsonPath"] == ".metadata.creationTimestamp"
            continue
        node = {"properties": status_props}
        for part in column["jsonPath"].removeprefix(".status.").split("."):
            assert part in (node.get("properties") or {}), name
            node = node["properties"][part]
    assert status_props["slo"]["enum"] == ["Met", "Violated", "Unknown"]


def test_conditions_follow_api_conventions(schema):
    item = schema["properties"]["status"]["properties"]["conditions"]["items"]
    assert set(item["properties"]) == {"type", "status", "reason", "message", "lastTransitionTime",
                                       "observedGeneration"}


def test_cel_rules_name_the_fields_they_check(schema):
    rules = [(p, r) for p, node in _walk(schema) for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 7
    for _path, rule in rules:
        assert rule["message"].split()[0].startswith(("spec.", "metadata.")), rule


def _apply_defaults(node: dict, value):
    """Structural defaulting as the API server does it (enough for this schema)."""
    if node.get("type") != "object" or not isinstance(value, dict):
        return value
    out = dict(value)
    for key, child in (node.get("properties") or {}).items():
        if key not in out and "default" in child:
            out[key] = child["default"]
        if key in out:
            out[key] = _apply_defaults(child, out[key])
    return out


def test_crd_defaults_match_the_operators_defaults(schema):
    minimal = {"model": {"source": "default"}}
    defaulted = _apply_defaults(schema["properties"]["spec"], minimal)
    assert defaulted != minimal  # defaults were applied
    assert parse_spec(defaulted) == parse_spec(minimal)


def test_autotune_fields_and_defaults_are_the_autotune_specs(schema):
    """Each spec.autotune default is written once, in AutotuneSpec: the CRD must say the same."""
    autotune = schema["properties"]["spec"]["properties"]["autotune"]["properties"]
    assert set(autotune) == set(AUTOTUNE_FIELDS)
    defaults = AutotuneSpec()
    for key, name in AUTOTUNE_FIELDS.items():
        ours = getattr(defaults, name)
        assert autotune[key]["default"] == (ours.value if hasattr(ours, "value") else ours), key
    top = schema["properties"]["spec"]["properties"]
    assert (top["minReplicas"]["default"], top["maxReplicas"]["default"]) == (defaults.min_replicas,
                                                                              defaults.max_replicas)


@pytest.mark.parametrize("source", [
    "default", "random:tiny", "random:llama-3.1-8b", "gguf:/models/a.gguf", "hf-dir:/models/llama",
    "pvc:weights", "pvc:weights/llama-3/model.gguf",
    "", "gguf:relative.gguf", "hf-dir:models/x", "s3://bucket/model", "pvc:Bad_Claim/x", "random:", "/models/a.gguf",
])
def test_the_crd_pattern_and_the_model_source_syntax_agree(schema, source):
    """The API server's first check (the pattern) and the operator's parser (metronome.contract.model_source plus
    its node-path rule) accept the same sources."""
    import re

    pattern = schema["properties"]["spec"]["properties"]["model"]["properties"]["source"]["pattern"]
    try:
        parse_source(source)
        parsed = True
    except SpecError:
        parsed = False
    assert bool(re.fullmatch(pattern, source)) == parsed


def test_server_fields_mirror_the_scheduler_schema(schema):
    server = schema["properties"]["spec"]["properties"]["server"]["properties"]
    for name, field in SchedulerConfig.model_fields.items():
        prop = server[field.alias]
        if field.default is not None:
            default = field.default.value if isinstance(field.default, QueuePolicy) else field.default
            assert prop["default"] == default, name
        for meta in field.metadata:
            if getattr(meta, "ge", None) is not None:
                assert prop["minimum"] == meta.ge, name
            if getattr(meta, "le", None) is not None:
                assert prop["maximum"] == meta.le, name
    assert set(server) == {f.alias for f in SchedulerConfig.model_fields.values()}
    assert server["queuePolicy"]["enum"] == [p.value for p in QueuePolicy]


def test_decision_record_fits_the_status_schema(schema):
    from metronome.operator.tuning.autotune import decision_record

    record = decision_record(time="2026-01-01T00:00:00Z", before=(4096, "fcfs", 2), after=(1024, "split", 2),
                             reason="TBT p99 80 ms > 50 ms", policy="model", applied=True)
    props = schema["properties"]["status"]["properties"]["lastDecision"]["properties"]
    assert set(record) == set(props)
    for side in ("from", "to"):
        assert set(record[side]) == set(props[side]["properties"])
    assert record["to"] == {"chunkSize": 1024, "queuePolicy": "split", "replicas": 2}


def test_experiment_candidate_fields_mirror_the_scheduler_schema_without_defaults(schema):
    """A candidate names only what differs: spec.server's fields and bounds, none defaulted, plus prefillBudget."""
    server = schema["properties"]["spec"]["properties"]["server"]["properties"]
    candidate = schema["properties"]["spec"]["properties"]["experiment"]["properties"]["candidate"]["properties"]
    assert set(candidate) == set(server) | {"prefillBudget"}
    for key, prop in candidate.items():
        assert "default" not in prop, key
        if key in server:
            assert {k: v for k, v in prop.items() if k not in ("description",)} == {
                k: v for k, v in server[key].items() if k not in ("description", "default")}, key


def test_experiment_defaults_are_the_experiment_specs(schema):
    from metronome.operator.experiment.settings import CandidateSpec, ExperimentSpec, Gates

    experiment = schema["properties"]["spec"]["properties"]["experiment"]
    defaulted = _apply_defaults(experiment, {"candidate": {"chunkSize": 256}})
    ours = ExperimentSpec(candidate=CandidateSpec({"chunk_size": 256}))
    assert defaulted["share"] == ours.share and defaulted["confidence"] == ours.confidence
    assert defaulted["minImprovementPercent"] / 100 == ours.min_improvement
    assert defaulted["minSamplesPerWindow"] == ours.min_samples
    gates = defaulted["gates"]
    assert (gates["tbtP99WorsePercent"] / 100, gates["ttftP99WorsePercent"] / 100, gates["goodputLowerPercent"] / 100,
            gates["errorRate"]) == (Gates().tbt_p99_worse, Gates().ttft_p99_worse, Gates().goodput_lower,
                                   Gates().error_rate)
    parsed = parse_spec(_apply_defaults(schema["properties"]["spec"], {"model": {"source": "default"},
                                                                       "experiment": defaulted}))
    assert parsed.experiment == ours  # windowSeconds follows spec.metrics (60), windows default 10


def test_experiment_status_fits_the_schema(schema):
    from metronome.contract.rfc3339 import format_time
    from metronome.operator.experiment.record import Phase, Record

    props = schema["properties"]["status"]["properties"]["experiment"]["properties"]
    record = Record(id="abc", source="spec", phase=Phase.RUNNING, reason="Measuring", message="m", name="n",
                    candidate={"chunkSize": 128}, candidate_pods=("a",), candidate_generation=4, control_generation=3,
                    started_at=1.0, measuring_since=2.0, decided_at=3.0, windows=2, windows_planned=10,
                    windows_skipped=1, ratios={"tbtP99": {"ratio": 0.5}})
    assert set(record.to_status(format_time)) == set(props)
    assert props["phase"]["enum"] == [p.value for p in Phase]

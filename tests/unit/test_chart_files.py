"""The chart's files against their single sources: the CRD is crds/inferenceservice.yaml itself (a symlink), the
PrometheusRule names only metrics of metronome.contract.metric_names, and every version is metronome.__version__.
tests/integration/test_chart.py renders and installs the chart with the Go-built helm."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from metronome import __version__
from metronome.contract import metric_names as names
from metronome.operator.spec import DEFAULT_IMAGE

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "metronome"
CRD = ROOT / "crds" / "inferenceservice.yaml"


def test_the_charts_crd_is_the_source_file():
    linked = CHART / "crds" / "inferenceservice.yaml"
    assert linked.is_symlink(), "charts/metronome/crds/inferenceservice.yaml must link to crds/, not copy it"
    assert linked.resolve() == CRD.resolve()
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["inferenceservice.yaml"]


def test_the_prometheus_rule_names_only_shared_metrics():
    text = (CHART / "templates" / "prometheusrule.yaml").read_text()
    used = set(re.findall(r"\b(metronome_[a-z0-9_]+)", text))
    assert used, "no metric found in the PrometheusRule"
    for metric in used:
        base = re.sub(r"_(bucket|sum|count)$", "", metric)
        assert metric in names.ALL_NAMES or base in names.ALL_NAMES, metric
    # The chart's alerts of every server: KV blocks leaked, config reload errors (each service's SLO alerts are the
    # operator's: operator/alerts.py).
    assert {names.KV_BLOCKS_LEAKED, names.CONFIG_RELOAD_ERRORS} <= used


def test_one_version_everywhere():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (__version__, __version__)
    assert DEFAULT_IMAGE.endswith(f":{__version__}")
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    # spec.image has no CRD default: unset is the operator's --server-image, whose default is DEFAULT_IMAGE.
    assert "default" not in spec["properties"]["image"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "metronome.__version__"}' in pyproject
    # Image tags written out in examples, docs and the images' build instructions.
    files = [*(ROOT / "examples").glob("*.yaml"), *(ROOT / "docs").glob("*.md"), *(ROOT / "images").glob("*"),
             ROOT / "README.md"]
    tags = 0
    for path in sorted(p for p in files if p.is_file()):
        for tag in re.findall(r"ghcr\.io/metronome-dev/metronome-[a-z]+:([\w.-]+)", path.read_text()):
            assert tag.split("-")[0] == __version__, path.name
            tags += 1
    assert tags, "no image tag found: the pattern no longer matches"

"""The local control plane is a real Kubernetes: scheduling onto kwok GPU nodes, CRDs, helm, /version."""

from __future__ import annotations

import re
import textwrap

import pytest

from metronome_testing.localcluster.tools import ToolSet

GPU = "nvidia.com/gpu"


def _kwok_gpu_nodes(cluster) -> dict[str, dict]:
    nodes = cluster.kubectl_json("get", "nodes")["items"]
    return {
        node["metadata"]["name"]: node
        for node in nodes
        if node["metadata"].get("annotations", {}).get("kwok.x-k8s.io/node") == "fake"
        and GPU in node["status"].get("capacity", {})
    }


def test_kubectl_get_nodes_shows_gpu_capacity(cluster):
    result = cluster.kubectl("get", "nodes", "-o",
                             r"custom-columns=NAME:.metadata.name,GPU:.status.capacity.nvidia\.com/gpu,"
                             r"ALLOC:.status.allocatable.nvidia\.com/gpu")
    rows = [line.split() for line in result.stdout.strip().splitlines()[1:]]
    gpu_rows = [row for row in rows if row[1] != "<none>"]
    assert len(gpu_rows) >= 2, result.stdout
    assert all(row[1] == "8" and row[2] == "8" for row in gpu_rows), result.stdout

    nodes = _kwok_gpu_nodes(cluster)
    assert len(nodes) >= 2
    for node in nodes.values():
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"


def test_gpu_deployment_runs_two_pods_on_kwok_gpu_nodes(cluster, k8s_namespace):
    manifest = textwrap.dedent(f"""
        apiVersion: apps/v1
        kind: Deployment
        metadata:
          name: gpu-app
        spec:
          replicas: 2
          selector:
            matchLabels: {{app: gpu-app}}
          template:
            metadata:
              labels: {{app: gpu-app}}
            spec:
              containers:
              - name: main
                image: example.invalid/never-pulled:1
                resources:
                  limits: {{"{GPU}": 1}}
        """)
    cluster.apply(manifest, namespace=k8s_namespace)
    cluster.kubectl("rollout", "status", "deployment/gpu-app", "-n", k8s_namespace, "--timeout=180s",
                    timeout=200)

    deployment = cluster.kubectl_json("get", "deployment", "gpu-app", "-n", k8s_namespace)
    assert deployment["status"]["readyReplicas"] == 2

    pods = cluster.kubectl_json("get", "pods", "-n", k8s_namespace, "-l", "app=gpu-app")["items"]
    running = [pod for pod in pods if pod["status"]["phase"] == "Running" and not pod["metadata"].get(
        "deletionTimestamp")]
    assert len(running) == 2
    gpu_nodes = _kwok_gpu_nodes(cluster)
    for pod in running:
        assert pod["spec"]["nodeName"] in gpu_nodes
        assert pod["spec"]["containers"][0]["resources"]["limits"][GPU] == "1"


def test_gpu_requests_beyond_capacity_stay_pending(cluster, k8s_namespace):
    """The scheduler really accounts for nvidia.com/gpu: a pod asking for more than any node has is unschedulable."""
    manifest = textwrap.dedent(f"""
        apiVersion: v1
        kind: Pod
        metadata:
          name: too-big
        spec:
          containers:
          - name: main
            image: example.invalid/never-pulled:1
            resources:
              limits: {{"{GPU}": 9}}
        """)
    cluster.apply(manifest, namespace=k8s_namespace)
    cluster.kubectl("wait", "pod/too-big", "-n", k8s_namespace, "--for=condition=PodScheduled=False",
                    "--timeout=120s", timeout=140)
    pod = cluster.kubectl_json("get", "pod", "too-big", "-n", k8s_namespace)
    scheduled = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"][0]
    assert scheduled["reason"] == "Unschedulable"
    assert GPU in scheduled["message"]
    assert pod["status"]["phase"] == "Pending"


def test_crd_and_custom_object_round_trip(cluster, k8s_namespace):
    crd = textwrap.dedent("""
        apiVersion: apiextensions.k8s.io/v1
        kind: CustomResourceDefinition
        metadata:
          name: widgets.clustertest.metronome.dev
        spec:
          group: clustertest.metronome.dev
          scope: Namespaced
          names: {plural: widgets, singular: widget, kind: Widget}
          versions:
          - name: v1
            served: true
            storage: true
            schema:
              openAPIV3Schema:
                type: object
                properties:
                  spec:
                    type: object
                    required: [size]
                    properties:
                      size: {type: integer, minimum: 1}
                      label: {type: string}
        """)
    cluster.apply(crd)
    cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.clustertest.metronome.dev",
                    "--timeout=60s")

    widget = textwrap.dedent("""
        apiVersion: clustertest.metronome.dev/v1
        kind: Widget
        metadata:
          name: w1
        spec:
          size: 3
          label: hello
        """)
    cluster.apply(widget, namespace=k8s_namespace)
    stored = cluster.kubectl_json("get", "widgets.clustertest.metronome.dev", "w1", "-n", k8s_namespace)
    assert stored["spec"] == {"size": 3, "label": "hello"}
    assert stored["metadata"]["uid"]

    invalid = widget.replace("size: 3", "size: 0").replace("name: w1", "name: w2")
    rejected = cluster.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=invalid, check=False)
    assert rejected.returncode != 0
    assert "spec.size" in rejected.stderr


def test_version_reports_the_real_release(cluster):
    version = cluster.kubectl_json("version")
    server = version["serverVersion"]
    assert re.fullmatch(r"v1\.\d+\.\d+", server["gitVersion"]), server
    # gitMajor/gitMinor come from separate ldflags; unset they are empty strings.
    assert server["gitVersion"].startswith(f"v{server['major']}.{server['minor']}.")
    if cluster.owns_control_plane:
        assert server["gitVersion"] == ToolSet.default().kubernetes_version
    raw = cluster.kubectl("get", "--raw", "/version").stdout
    assert server["gitVersion"] in raw


@pytest.fixture
def trivial_chart(tmp_path):
    chart = tmp_path / "trivial"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(textwrap.dedent("""
        apiVersion: v2
        name: trivial
        description: A one-ConfigMap chart for the cluster tests
        version: 0.1.0
        kubeVersion: ">=1.30.0-0"
        """))
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "configmap.yaml").write_text(textwrap.dedent("""
        apiVersion: v1
        kind: ConfigMap
        metadata:
          name: {{ .Release.Name }}-trivial
        data:
          greeting: {{ .Values.greeting | quote }}
          kubeVersion: {{ .Capabilities.KubeVersion.Version | quote }}
        """))
    return chart


def test_helm_lint_and_template_know_the_cluster_version(cluster, trivial_chart):
    lint = cluster.helm("lint", str(trivial_chart))
    assert "1 chart(s) linted, 0 chart(s) failed" in lint.stdout

    rendered = cluster.helm("template", "demo", str(trivial_chart), "--set", "greeting=hi").stdout
    assert "name: demo-trivial" in rendered
    assert 'greeting: "hi"' in rendered
    major_minor = ".".join(ToolSet.default().kubernetes_version.split(".")[:2])
    assert f'kubeVersion: "{major_minor}.' in rendered


def test_helm_installs_into_the_cluster(cluster, trivial_chart, k8s_namespace):
    cluster.helm("install", "demo", str(trivial_chart), "-n", k8s_namespace, "--wait", "--timeout", "60s")
    configmap = cluster.kubectl_json("get", "configmap", "demo-trivial", "-n", k8s_namespace)
    assert configmap["data"]["greeting"] == "hello"
    assert configmap["data"]["kubeVersion"].startswith("v1.")
    cluster.helm("uninstall", "demo", "-n", k8s_namespace)

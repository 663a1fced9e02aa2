"""An idle operator costs the API server nothing per service: the request rate of the whole control plane, read from
kube-apiserver's own `apiserver_request_total`, is measured with 1 idle InferenceService and again with SERVICES,
and must stay within 2× (the control plane's own background — kwok's node leases, the controllers — is the same in
both). Before the operator read its watches' cache, each service cost 4 GETs per reading interval.

The services read Prometheus every 5 s (autotune's shortest interval), so a per-service poll would show within the
window many times over. The module has a control plane of its own: namespaces that other tests leave being deleted
must not count.
"""
from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from metronome_testing.chart import chart_release, service_account_kubeconfig
from metronome_testing.kube_objects import condition
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for

SERVICES = 40
WINDOW_S = 20.0
SETTLE_S = 5.0  # after the last change, before a window: the controllers' own trailing writes
REQUEST_TOTAL = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$', re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A control plane of this module's own (overrides the session's `cluster`)."""
    from metronome_testing.localcluster.session import private_cluster

    with private_cluster(tmp_path_factory.mktemp("idle-cluster")) as handle:
        yield handle


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    release = chart_release(cluster)
    work = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cluster, release.namespace, release.service_account, work / "kubeconfig")
    process = OperatorProcess(kubeconfig=kubeconfig, log_dir=work)
    process.start()
    yield process
    process.stop()


def manifest(name: str) -> str:
    return f"""apiVersion: metronome.dev/v1alpha1
kind: InferenceService
metadata: {{name: {name}}}
spec:
  model: {{source: "random:tiny"}}
  replicas: 1
  resources: {{gpus: 0, cpu: 100m, memory: 1Gi}}
  slo: {{tbtP99Ms: 50}}
  autotune: {{mode: apply, intervalSeconds: 5}}
"""


def requests_so_far(cluster) -> Counter:
    """Every request the API server has answered, by verb and resource, long-running watches aside (their count
    moves when they end)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    counts: Counter = Counter()
    for match in REQUEST_TOTAL.finditer(text):
        labels = dict(LABEL.findall(match["labels"]))
        if labels.get("verb") != "WATCH":
            key = (labels.get("verb"), labels.get("resource"), labels.get("subresource") or "")
            counts[key] += float(match["value"])
    return counts


def idle_rate(cluster) -> tuple[float, Counter]:
    """Requests per second over WINDOW_S in which nothing is asked of the cluster but this reading itself, and
    what they were."""
    time.sleep(SETTLE_S)
    before = requests_so_far(cluster)
    started = time.monotonic()
    time.sleep(WINDOW_S)  # the idle window itself: nothing to poll for
    moved = requests_so_far(cluster)
    moved.subtract(before)
    return sum(moved.values()) / (time.monotonic() - started), +moved


def all_settled(cluster, ns: str, count: int) -> bool:
    items = cluster.kubectl_json("get", "inferenceservices.metronome.dev", "-n", ns)["items"]
    pods = cluster.kubectl_json("get", "pods", "-n", ns)["items"]
    settled = [i for i in items if (i.get("status") or {}).get("observedGeneration") == i["metadata"]["generation"]
               and (condition(i, "Ready") or {}).get("status") == "True"]
    running = [p for p in pods if p["status"].get("phase") == "Running"]
    return len(settled) == count and len(running) == count


def test_idle_requests_do_not_grow_with_the_number_of_services(cluster, operator):
    ns = cluster.namespace("idle")
    cluster.apply(manifest("svc-0"), namespace=ns)
    wait_for(lambda: all_settled(cluster, ns, 1), "one service Ready", timeout=120)
    one, _ = idle_rate(cluster)

    cluster.apply("---\n".join(manifest(f"svc-{i}") for i in range(1, SERVICES)), namespace=ns)
    wait_for(lambda: all_settled(cluster, ns, SERVICES), f"{SERVICES} services Ready", timeout=300)
    many, what = idle_rate(cluster)
    assert many <= 2 * one, (f"idle API requests: {one:.2f}/s with 1 service, {many:.2f}/s with {SERVICES}: "
                             f"{what.most_common(8)}")
    assert operator.process.poll() is None

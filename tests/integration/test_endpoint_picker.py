"""Routing through the ecosystem's endpoint picker, for real: the Gateway API Inference Extension's picker (v1.5.0,
built from Go modules by hack/build-picker.sh) in front of an InferenceService with spec.routing.inferencePool.

The operator (under the chart's RBAC) writes the InferencePool; the kubelet stand-in runs a real `metronome serve`
for each of the two pods and plays the pod network (each server on port 8000 of its own 127.0.0.x, which becomes
the pod's IP); the picker runs under the ServiceAccount and Role of examples/endpoint-picker.yaml, discovers the
pods through the API server and scrapes their /metrics under vLLM's names. It is asked the way a gateway asks
(ext_proc gRPC): with one pod's queue full and the other idle, every pick is the idle pod, and the other way round
once the load moves — the picker read Metronome's metrics. It is started only after every pod of the pool has a
loopback IP, and its log must never name a 10.x address (kwok's fake pod IPs are never contacted).
"""
from __future__ import annotations

import re
import uuid

import pytest
import yaml

from metronome.contract.metric_names import PICKER_ENGINE_TYPE
from metronome.operator import builders
from metronome_testing.chart import chart_release, service_account_kubeconfig
from metronome_testing.checkout import ROOT
from metronome_testing.closedloop import LoadDriver, LoadSpec
from metronome_testing.endpoint_picker import EndpointPicker, install_pool_crd
from metronome_testing.ext_proc import pick
from metronome_testing.kube_objects import get_json
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for
from metronome_testing.standin import KubeletStandIn, StandInOptions

EXAMPLE = ROOT / "examples" / "endpoint-picker.yaml"
NAME = "chat"  # the example's InferenceService, pool and picker (chat-epp)
PICKS = 8
# A full queue: one request runs at a time (server.maxNumSeqs 1) while the load keeps 6 in flight.
LOAD = LoadSpec(concurrency_per_server=6, long_fraction=0.0, short_prompt_len=32, output_len=64, seed=3)
SERVER_ARGS = ("--kv-cache-memory-gb", "0.25", "--drain-seconds", "1", "--log-level", "warning")


def example() -> tuple[list[dict], dict]:
    """The example's picker objects, and its InferenceService made cheap for a CPU: random tiny weights, one
    running request at a time (everything else queues)."""
    docs = [doc for doc in yaml.safe_load_all(EXAMPLE.read_text()) if doc]
    (service,) = [doc for doc in docs if doc["kind"] == "InferenceService"]
    service["spec"].update(model={"source": "random:tiny"}, server={"maxNumSeqs": 1},
                           resources={"gpus": 1, "cpu": "1", "memory": "2Gi"})
    return [doc for doc in docs if doc["kind"] != "InferenceService"], service


@pytest.fixture(scope="module")
def ns(cluster):
    return cluster.namespace("picker")


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    install_pool_crd(cluster)
    release = chart_release(cluster)
    work = tmp_path_factory.mktemp("picker-operator")
    kubeconfig = service_account_kubeconfig(cluster, release.namespace, release.service_account, work / "kubeconfig")
    process = OperatorProcess(kubeconfig=kubeconfig, log_dir=work)
    process.start()
    yield process
    process.stop()
    assert "Forbidden" not in process.all_logs(), "the operator hit an RBAC denial:\n" + process.all_logs()[-4000:]


@pytest.fixture(scope="module")
def standin(cluster, ns, tmp_path_factory):
    options = StandInOptions(work_dir=tmp_path_factory.mktemp("picker-standin"), namespaces=(ns,),
                             extra_args=SERVER_ARGS, pod_network=True)
    with KubeletStandIn(cluster.kubeconfig, options) as harness:
        yield harness


def _pod_ips(cluster, ns) -> dict[str, str]:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", builders.selector_string(NAME))["items"]
    return {p["metadata"]["name"]: (p.get("status") or {}).get("podIP", "") for p in pods
            if not p["metadata"].get("deletionTimestamp")}


@pytest.fixture(scope="module")
def servers(cluster, ns, operator, standin):
    picker_objects, service = example()
    cluster.apply("---\n".join(yaml.safe_dump(doc) for doc in [*picker_objects, service]), ns)
    servers = standin.wait_for_servers(2, namespace=ns, service=NAME, timeout_s=300)
    addresses = {s.pod: s.address for s in servers}
    wait_for(lambda: _pod_ips(cluster, ns) == addresses, "every pod's IP to be its server's loopback address",
             timeout=60)
    return servers


def test_the_operator_keeps_an_inference_pool_of_the_services_pods(cluster, ns, servers):
    pool = wait_for(lambda: get_json(cluster, "inferencepools.inference.networking.k8s.io", NAME, "-n", ns),
                    "the operator to write the InferencePool", timeout=60)
    isvc = get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", ns)
    assert [ref["uid"] for ref in pool["metadata"]["ownerReferences"]] == [isvc["metadata"]["uid"]]
    assert pool["spec"]["selector"]["matchLabels"] == builders.selector_labels(NAME)
    assert pool["spec"]["targetPorts"] == [{"number": builders.SERVER_PORT}]
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]["number"], ref["failureMode"]) == ("Service", "chat-epp", 9002,
                                                                                      "FailClose")
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", builders.selector_string(NAME))["items"]
    assert all(p["metadata"]["labels"]["llm-d.ai/engine-type"] == PICKER_ENGINE_TYPE for p in pods)


def _ask(picker: EndpointPicker) -> list[str]:
    """PICKS requests' destinations, each with a prompt of its own (no prefix-cache affinity between them)."""
    return [pick(picker.target, {"model": NAME, "prompt": f"request {uuid.uuid4()}", "max_tokens": 8}).endpoint
            for _ in range(PICKS)]


def _loaded(queues: dict[str, float], busy: str, idle: str) -> bool:
    return queues.get(busy, 0) >= 3 and queues.get(idle) == 0


def test_the_picker_sends_every_request_to_the_idle_pod(cluster, ns, servers, tmp_path):
    kubeconfig = service_account_kubeconfig(cluster, ns, "chat-epp", tmp_path / "picker.kubeconfig")
    assert all(ip.startswith("127.") for ip in _pod_ips(cluster, ns).values())  # never start it on kwok's 10.x
    with EndpointPicker(kubeconfig, NAME, ns, tmp_path / "picker.log") as picker:
        wait_for(lambda: set(picker.queue_sizes()) == {s.pod for s in servers},
                 f"the picker to see both pods (log {picker.log_path})", timeout=90)
        for busy, idle in (servers, reversed(servers)):
            load = LoadDriver([busy.base_url], LOAD).start()
            try:
                wait_for(lambda busy=busy, idle=idle: _loaded(picker.queue_sizes(), busy.pod, idle.pod),
                         f"the picker to read {busy.pod}'s full queue and {idle.pod}'s empty one", timeout=60,
                         interval=0.1)
                assert _ask(picker) == [f"{idle.address}:{builders.SERVER_PORT}"] * PICKS, picker.queue_sizes()
            finally:
                load.stop()
            wait_for(lambda busy=busy: picker.queue_sizes().get(busy.pod) == 0, f"{busy.pod} to drain",
                     timeout=120)
        log = picker.log_text()
    assert "Request handled" in log
    assert not re.search(r"\b10\.\d+\.\d+\.\d+", log), "the picker saw a kwok pod IP"


def test_turning_routing_off_deletes_the_pool(cluster, ns, servers):
    cluster.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge", "-p",
                    '{"spec": {"routing": {"inferencePool": {"enabled": false}}}}')
    wait_for(lambda: get_json(cluster, "inferencepools.inference.networking.k8s.io", NAME, "-n", ns) is None,
             "the operator to delete the InferencePool", timeout=60)

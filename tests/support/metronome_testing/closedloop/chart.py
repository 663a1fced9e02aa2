"""Install the chart and give the locally run operator the chart's identity (its ServiceAccount's token)."""
from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "metronome"
CRD_NAME = "inferenceservices.metronome.dev"


def install_chart(kube, release: str, namespace: str, values: dict[str, str] | None = None) -> str:
    """`helm upgrade --install` (idempotent) into `namespace`; waits for the CRD. Returns the ServiceAccount name.

    `kube` is a localcluster KubeTools (the test fixture or the demo's handle)."""
    sets = [arg for key, value in (values or {}).items() for arg in ("--set", f"{key}={value}")]
    kube.helm("upgrade", "--install", release, str(CHART), "--namespace", namespace, "--create-namespace", *sets,
              timeout=180)
    kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    # The chart's fullname: the release name when it contains the chart's name, else "<release>-metronome".
    return release if "metronome" in release else f"{release}-metronome"


def service_account_kubeconfig(kube, namespace: str, service_account: str, path: Path,
                               duration: str = "24h") -> Path:
    """A kubeconfig for the same API server that authenticates as the ServiceAccount (TokenRequest token)."""
    token = kube.kubectl("create", "token", service_account, "-n", namespace, f"--duration={duration}").stdout.strip()
    admin = yaml.safe_load(Path(kube.kubeconfig).read_text())
    context_name = admin.get("current-context") or admin["contexts"][0]["name"]
    context = next(c for c in admin["contexts"] if c["name"] == context_name)["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"]
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": service_account, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": service_account}}],
        "current-context": "operator",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path

"""kubectl and helm bound to one cluster's kubeconfig: the handle that tests get from the `cluster` fixture."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ClusterError

DEFAULT_TIMEOUT_S = 120.0


class CommandError(ClusterError):
    """kubectl or helm exited non-zero; the message carries the command, exit status and stderr."""

    def __init__(self, result: subprocess.CompletedProcess):
        self.result = result
        super().__init__(f"`{' '.join(map(str, result.args))}` exited with {result.returncode}:\n"
                         f"{(result.stderr or '').strip()}\n{(result.stdout or '').strip()}".rstrip())


@dataclass
class KubeTools:
    kubeconfig: Path
    bin_dir: Path
    api_url: str
    logs_dir: Path | None = None
    prometheus_url: str | None = None
    created_namespaces: list[str] = field(default_factory=list)

    @property
    def kubectl_path(self) -> Path:
        return self.bin_dir / "kubectl"

    @property
    def helm_path(self) -> Path:
        return self.bin_dir / "helm"

    @property
    def env(self) -> dict[str, str]:
        """os.environ with KUBECONFIG set and the tool folder first on PATH (for subprocesses of tests)."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def _run(self, argv: list[str], input: str | None, check: bool, timeout: float) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, input=input, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and result.returncode != 0:
            raise CommandError(result)
        return result

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess:
        return self._run([str(self.kubectl_path), *map(str, args)], input, check, timeout)

    def kubectl_json(self, *args: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
        result = self.kubectl(*args, "-o", "json", timeout=timeout)
        try:
            return json.loads(result.stdout)
        except ValueError as error:
            raise ClusterError(f"kubectl {' '.join(args)} did not print JSON: {result.stdout[:500]!r}") from error

    def helm(self, *args: str, input: str | None = None, check: bool = True,
             timeout: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess:
        return self._run([str(self.helm_path), *map(str, args)], input, check, timeout)

    def apply(self, manifest: str, namespace: str | None = None) -> subprocess.CompletedProcess:
        ns_args = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns_args, "-f", "-", input=manifest)

    def namespace(self, base: str) -> str:
        """Creates a fresh namespace named `<base>-<random>` and returns its name."""
        name = f"{base}-{secrets.token_hex(3)}"
        self.kubectl("create", "namespace", name)
        self.created_namespaces.append(name)
        return name

    def delete_created_namespaces(self) -> None:
        """Best-effort cleanup for clusters that outlive the test session (an existing cluster)."""
        for name in self.created_namespaces:
            self.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
        self.created_namespaces.clear()

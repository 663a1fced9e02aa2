"""Certificates and keys for the local control plane, made with the `openssl` CLI.

One CA signs the API server's serving certificate and the admin client certificate (group system:masters);
a separate RSA key pair signs and verifies service-account tokens.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .errors import ClusterStartError

SERVING_SANS = (
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
    "IP:127.0.0.1",
)
VALID_DAYS = "3650"


@dataclass(frozen=True)
class Pki:
    dir: Path

    ca_cert = property(lambda self: self.dir / "ca.crt")
    ca_key = property(lambda self: self.dir / "ca.key")
    serving_cert = property(lambda self: self.dir / "apiserver.crt")
    serving_key = property(lambda self: self.dir / "apiserver.key")
    admin_cert = property(lambda self: self.dir / "admin.crt")
    admin_key = property(lambda self: self.dir / "admin.key")
    sa_key = property(lambda self: self.dir / "sa.key")
    sa_pub = property(lambda self: self.dir / "sa.pub")

    def complete(self) -> bool:
        files = (self.ca_cert, self.ca_key, self.serving_cert, self.serving_key, self.admin_cert, self.admin_key,
                 self.sa_key, self.sa_pub)
        return all(path.is_file() for path in files)


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise ClusterStartError("the `openssl` command is needed to make the cluster's certificates")
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterStartError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", path.name, cwd=path.parent)
    path.chmod(0o600)


def _signed_cert(pki: Pki, key: Path, cert: Path, subject: str, extensions: str) -> None:
    csr = cert.with_suffix(".csr")
    ext = cert.with_suffix(".ext")
    ext.write_text(extensions, encoding="utf-8")
    _openssl("req", "-new", "-key", key.name, "-subj", subject, "-out", csr.name, cwd=pki.dir)
    _openssl("x509", "-req", "-in", csr.name, "-CA", pki.ca_cert.name, "-CAkey", pki.ca_key.name,
             "-CAcreateserial", "-days", VALID_DAYS, "-sha256", "-extfile", ext.name, "-out", cert.name, cwd=pki.dir)
    csr.unlink()
    ext.unlink()


def make_pki(directory: Path) -> Pki:
    """Creates (or keeps, when already complete) every key and certificate in `directory`."""
    pki = Pki(directory)
    if pki.complete():
        return pki
    directory.mkdir(parents=True, exist_ok=True)
    _new_key(pki.ca_key)
    _openssl("req", "-x509", "-new", "-key", pki.ca_key.name, "-subj", "/CN=metronome-local-ca", "-days", VALID_DAYS,
             "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", "-out", pki.ca_cert.name,
             cwd=directory)
    _new_key(pki.serving_key)
    _signed_cert(pki, pki.serving_key, pki.serving_cert, "/CN=kube-apiserver",
                 "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                 "extendedKeyUsage=serverAuth\nsubjectAltName=" + ",".join(SERVING_SANS) + "\n")
    _new_key(pki.admin_key)
    _signed_cert(pki, pki.admin_key, pki.admin_cert, "/O=system:masters/CN=metronome-admin",
                 "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                 "extendedKeyUsage=clientAuth\n")
    _new_key(pki.sa_key)
    _openssl("pkey", "-in", pki.sa_key.name, "-pubout", "-out", pki.sa_pub.name, cwd=directory)
    return pki


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode("ascii")


def kubeconfig_text(pki: Pki, api_url: str, name: str = "metronome-local") -> str:
    """An admin kubeconfig with the certificates embedded, so it stays valid wherever it is copied."""
    return f"""apiVersion: v1
kind: Config
clusters:
- name: {name}
  cluster:
    server: {api_url}
    certificate-authority-data: {_b64(pki.ca_cert)}
users:
- name: {name}-admin
  user:
    client-certificate-data: {_b64(pki.admin_cert)}
    client-key-data: {_b64(pki.admin_key)}
contexts:
- name: {name}
  context:
    cluster: {name}
    user: {name}-admin
current-context: {name}
"""

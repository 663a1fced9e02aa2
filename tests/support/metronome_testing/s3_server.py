"""An S3-compatible object server on 127.0.0.1 for tests: Versity's versitygw (a real S3 gateway: SigV4 auth,
ListObjectsV2, multipart, ETags) over a POSIX folder, built from its Go module by hack/build-s3-server.sh."""
from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from metronome.server.bench.processes import free_port
from metronome_testing.checkout import HACK

BUILD_SCRIPT = HACK / "build-s3-server.sh"
ACCESS_KEY = "metronome-test"
SECRET_KEY = "metronome-test-secret-0123456789"


def s3_server_binary() -> Path:
    """The versitygw binary, built first if missing (minutes once; cached under ~/.cache/metronome/bin)."""
    printed = subprocess.run([str(BUILD_SCRIPT), "--print"], capture_output=True, text=True, check=True).stdout
    path = Path(printed.strip())
    if not path.is_file():
        build = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True)
        assert build.returncode == 0 and path.is_file(), (
            f"hack/build-s3-server.sh failed:\n{build.stdout}\n{build.stderr}")
    return path


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    process: subprocess.Popen
    log_path: Path

    def client(self, access_key: str | None = None, secret_key: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=access_key or self.access_key,
                            aws_secret_access_key=secret_key or self.secret_key,
                            config=Config(s3={"addressing_style": "path"}))

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through boto3's standard variables."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}

    def upload_folder(self, bucket: str, prefix: str, folder: Path) -> None:
        client = self.client()
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_s3_server(root: Path) -> S3Server:
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = root / "versitygw.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([str(s3_server_binary()), "--access", ACCESS_KEY, "--secret", SECRET_KEY,
                                    "--port", f"127.0.0.1:{port}", "posix", str(data)],
                                   stdout=log, stderr=subprocess.STDOUT)
    server = S3Server(f"http://127.0.0.1:{port}", ACCESS_KEY, SECRET_KEY, process, log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, f"versitygw exited {process.returncode}:\n{log_path.read_text()}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise AssertionError(f"versitygw did not listen on 127.0.0.1:{port} within 30 s:\n{log_path.read_text()}")

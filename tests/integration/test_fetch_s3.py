"""s3:// sources through boto3 against a real S3 server (versitygw, built from Go modules) on 127.0.0.1:
SigV4 auth, ListObjectsV2, multipart uploads' ETags, managed multipart downloads, and the errors a bucket gives."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metronome.contract.errors import ModelNotFoundError
from metronome.server.models.default_model import default_model_path
from metronome.server.models.fetch import fetch_model
from metronome_testing.s3_server import start_s3_server

METRONOME = str(Path(sys.executable).parent / "metronome")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = start_s3_server(tmp_path_factory.mktemp("s3"))
    client = server.client()
    client.create_bucket(Bucket="models")
    client.upload_file(str(default_model_path()), "models", "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")  # multipart
    client.put_object(Bucket="models", Key="smollm2/README.md", Body=b"not a weight file")
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    return s3.env()


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([METRONOME, *args], capture_output=True, text=True, timeout=600, env={**os.environ, **env})


def generate(spec: str, env: dict[str, str]) -> list[dict]:
    result = run_cli("generate", "--model", spec, "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32",
                     "--max-tokens", "6", "--json", "--prompt", "The capital of France is", env=env)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_fetch_model_downloads_a_gguf_that_generates_like_the_local_file(s3, tmp_path):
    env = {**s3.env(), "METRONOME_MODEL_CACHE": str(tmp_path)}
    result = run_cli("fetch-model", "s3://models/smollm2", env=env)
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert sorted(p.name for p in folder.iterdir()) == [".metronome-fetch.json", "SmolLM2-135M-Instruct.Q4_1.gguf"]
    marker = json.loads((folder / ".metronome-fetch.json").read_text())
    head = s3.client().head_object(Bucket="models", Key="smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert marker["files"] == [{"path": "SmolLM2-135M-Instruct.Q4_1.gguf", "size": head["ContentLength"],
                                "etag": head["ETag"].strip('"')}]
    assert (folder / marker["files"][0]["path"]).read_bytes() == default_model_path().read_bytes()
    assert generate("s3://models/smollm2", env) == generate("default", env)  # loads the cached copy

    # Idempotent: the complete copy is found again without the network (the endpoint below does not answer).
    again = run_cli("fetch-model", "s3://models/smollm2", "--s3-endpoint", "http://127.0.0.1:9", env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == str(folder) and "cached in" in again.stderr


def test_a_single_object_key_is_a_source(s3_env, tmp_path):
    fetched = fetch_model("s3://models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path)
    assert fetched.local_spec.endswith("/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_a_hf_folder_in_a_bucket(s3, s3_env, tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"w" * 100)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "training_args.bin").write_bytes(b"x")
    s3.upload_folder("models", "team/tiny", folder)
    fetched = fetch_model("s3://models/team/tiny/", tmp_path / "cache")
    assert sorted(f.path for f in fetched.marker.files) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert fetched.local_spec == f"hf-dir:{fetched.folder}"


@pytest.mark.parametrize("uri, says", [
    ("s3://no-such-bucket/x", "bucket not found"),
    ("s3://models/nothing-here", "no objects under this prefix"),
])
def test_missing_buckets_and_prefixes_name_the_source(s3_env, tmp_path, uri, says):
    with pytest.raises(ModelNotFoundError, match=f"{uri} \\(endpoint http://127.0.0.1:\\d+\\): {says}"):
        fetch_model(uri, tmp_path)


def test_refused_credentials_say_so(s3_env, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ModelNotFoundError, match=r"s3://models/smollm2 .*access refused \(SignatureDoesNotMatch\)"):
        fetch_model("s3://models/smollm2", tmp_path)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ModelNotFoundError, match=r"access refused \(AccessDenied\)"):  # unsigned: not a public bucket
        fetch_model("s3://models/smollm2", tmp_path)
    assert not list((tmp_path / ".partial").iterdir())


def test_credentials_from_a_mounted_file(s3, s3_env, tmp_path, monkeypatch):
    """What a Secret mounted as a file gives: boto3's shared-credentials file instead of variables."""
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = {s3.secret_key}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    assert fetch_model("s3://models/smollm2", tmp_path / "cache").downloaded


def test_an_unreachable_endpoint_says_so(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"s3://models/x \(endpoint http://127.0.0.1:9\): cannot reach"):
        fetch_model("s3://models/x", tmp_path, s3_endpoint="http://127.0.0.1:9")

"""hf:// sources through the real huggingface_hub client against tests/hub_server.py on 127.0.0.1.

What this proves: our calls into huggingface_hub (repo info → commit sha, tree listing, snapshot_download with
allow_patterns into a local folder, LFS redirects to another host, the bearer token from HF_TOKEN, HF_ENDPOINT)
work end to end over HTTP, and each failure the Hub signals by status and X-Error-Code becomes one clear error.
What it does not: the real Hub's account and token-scope rules, Xet storage (the server sends no X-Xet-* headers,
so the client takes its plain HTTP path), rate limits, long paginated listings, CDN signatures.
"""
from __future__ import annotations

import json

import pytest
from test_loaders import SMALL, save_hf_model

from metronome.cli import main
from metronome.contract.errors import ModelNotFoundError
from metronome.server.models.fetch import fetch_model
from metronome.server.models.loader import ModelSource, parse_model_spec
from metronome_testing.hub_server import FakeHub


@pytest.fixture
def hub():
    with FakeHub() as server:
        yield server


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-llama")
    save_hf_model(folder, LlamaConfig(**SMALL, tie_word_embeddings=False))
    (folder / "README.md").write_text("a tiny random Llama")
    (folder / "pytorch_model.bin").write_bytes(b"not read by our loader, so never downloaded")
    return folder


def generate(capsys, spec: str) -> list[dict]:
    rc = main(["generate", "--model", spec, "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32",
               "--max-tokens", "5", "--ignore-eos", "--json", "--prompt", "hello world", "--prompt", "abc"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_a_hub_folder_downloads_what_the_loader_reads_and_generates_like_the_original(hub, tiny_folder, tmp_path,
                                                                                      capsys, monkeypatch):
    repo = hub.add_folder("test-org/tiny-llama", tiny_folder)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("METRONOME_MODEL_CACHE", str(tmp_path))
    assert generate(capsys, "hf://test-org/tiny-llama") == generate(capsys, f"hf-dir:{tiny_folder}")

    fetched = fetch_model("hf://test-org/tiny-llama", tmp_path, hf_endpoint=hub.url)
    assert fetched.marker.resolved == repo.sha
    assert fetched.folder.parent == tmp_path / "hf"
    got = sorted(p.name for p in fetched.folder.iterdir())
    assert "README.md" not in got and "pytorch_model.bin" not in got
    assert {"config.json", "model.safetensors", "tokenizer.json", ".metronome-fetch.json"} <= set(got)
    for f in fetched.marker.files:
        assert (fetched.folder / f.path).read_bytes() == (tiny_folder / f.path).read_bytes()
    assert any(path.startswith("/lfs/") for _, path, _ in hub.requests)  # the weights came through the "CDN"
    assert not fetched.downloaded  # generate's load above already put it there
    assert parse_model_spec("hf://test-org/tiny-llama") == ModelSource("hf-dir", str(fetched.folder),
                                                                        "test-org/tiny-llama")


def test_a_second_fetch_is_a_no_op_without_network(hub, tiny_folder, tmp_path):
    hub.add_folder("test-org/tiny-llama", tiny_folder)
    first = fetch_model("hf://test-org/tiny-llama@main", tmp_path, hf_endpoint=hub.url)
    seen = len(hub.requests)
    second = fetch_model("hf://test-org/tiny-llama", tmp_path, hf_endpoint="http://127.0.0.1:9")  # unreachable
    assert not second.downloaded and second.folder == first.folder and len(hub.requests) == seen


def test_a_private_repo_needs_its_token(hub, tmp_path, monkeypatch):
    hub.add_repo("team/private", {"only.gguf": b"GGUF-bytes"}, token="hf_right")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ModelNotFoundError, match=r"hf://team/private@main .*repo not found, or private"):
        fetch_model("hf://team/private", tmp_path, hf_endpoint=hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ModelNotFoundError, match=r"access refused \(HTTP 401\); check HF_TOKEN"):
        fetch_model("hf://team/private", tmp_path, hf_endpoint=hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_right")
    before = len(hub.requests)
    fetched = fetch_model("hf://team/private", tmp_path, hf_endpoint=hub.url)
    assert (fetched.folder / "only.gguf").read_bytes() == b"GGUF-bytes"
    assert fetched.local_spec == f"gguf:{fetched.folder / 'only.gguf'}"
    to_hub = {auth for _, path, auth in hub.requests[before:] if not path.startswith("/lfs/")}
    to_cdn = {auth for _, path, auth in hub.requests[before:] if path.startswith("/lfs/")}
    assert to_hub == {"Bearer hf_right"} and to_cdn == {None}  # the token never leaves the Hub's host
    assert not list((tmp_path / ".partial").iterdir())  # the failed attempts left nothing behind


def test_one_file_of_a_multi_quant_gguf_repo(hub, tmp_path):
    hub.add_repo("q/model-GGUF", {"m.Q4_0.gguf": b"four", "m.Q8_0.gguf": b"eight", "README.md": b"x"}, tags=("v1",))
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        fetch_model("hf://q/model-GGUF", tmp_path, hf_endpoint=hub.url)
    fetched = fetch_model("hf://q/model-GGUF/m.Q8_0.gguf@v1", tmp_path, hf_endpoint=hub.url)
    assert sorted(p.name for p in fetched.folder.iterdir()) == [".metronome-fetch.json", "m.Q8_0.gguf"]
    with pytest.raises(ModelNotFoundError, match="the repo has no file 'm.F16.gguf'"):
        fetch_model("hf://q/model-GGUF/m.F16.gguf", tmp_path, hf_endpoint=hub.url)


@pytest.mark.parametrize("uri, says", [
    ("hf://nobody/nothing", "repo not found"),
    ("hf://q/gated", "gated"),
    ("hf://q/model@v404", "revision 'v404' not found"),
])
def test_hub_refusals_name_the_source(hub, tmp_path, uri, says):
    hub.add_repo("q/gated", {"m.gguf": b"x"}, gated=True)
    hub.add_repo("q/model", {"m.gguf": b"x"})
    with pytest.raises(ModelNotFoundError, match=says) as error:
        fetch_model(uri, tmp_path, hf_endpoint=hub.url)
    assert str(error.value).startswith(uri.split("@")[0]) and hub.url in str(error.value)


def test_an_unreachable_hub_says_so(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"hf://o/n@main \(from http://127.0.0.1:9\): cannot reach the Hub"):
        fetch_model("hf://o/n", tmp_path, hf_endpoint="http://127.0.0.1:9")


def test_fetch_model_cli_uses_hf_endpoint_and_prints_the_folder(hub, tmp_path, monkeypatch, capsys):
    hub.add_repo("q/model", {"m.gguf": b"x"})
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("METRONOME_MODEL_CACHE", str(tmp_path))
    assert main(["fetch-model", "hf://q/model"]) == 0
    folder = capsys.readouterr().out.strip()
    assert folder.startswith(str(tmp_path / "hf" / "q--model@main-")) and (tmp_path / folder / "m.gguf").is_file()
    assert main(["fetch-model", "hf://q/none"]) == 1
    assert "metronome fetch-model: error: hf://q/none@main" in capsys.readouterr().err

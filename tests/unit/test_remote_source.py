"""hf:// and s3:// URIs, cache naming, file selection and the cache's atomic publish (pure, no network)."""
from __future__ import annotations

import os

import pytest

from metronome.contract.errors import ModelNotFoundError
from metronome.contract.model_source import ModelSourceError
from metronome.contract.remote_source import HubSource, S3Source, cache_subdir, is_remote, parse_remote
from metronome.server.models.fetch.cache import (
    STALE_PARTIAL_SECONDS,
    Marker,
    RemoteFile,
    new_partial,
    publish,
    read_complete,
)
from metronome.server.models.fetch.files import local_model_spec, select_model_files


@pytest.mark.parametrize("uri, repo, revision, filename, normalised", [
    ("hf://HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", "main", None, "hf://HuggingFaceTB/SmolLM2-135M@main"),
    ("hf://org/name@v1.0", "org/name", "v1.0", None, "hf://org/name@v1.0"),
    ("hf://org/name@refs/pr/3", "org/name", "refs/pr/3", None, "hf://org/name@refs/pr/3"),
    ("hf://org/name/q8/model-Q8_0.gguf@abc123", "org/name", "abc123", "q8/model-Q8_0.gguf",
     "hf://org/name/q8/model-Q8_0.gguf@abc123"),
])
def test_hf_uris_parse(uri, repo, revision, filename, normalised):
    source = parse_remote(uri)
    assert source == HubSource(repo, revision, filename, normalised)
    assert source.name == repo


@pytest.mark.parametrize("uri, bucket, prefix, normalised", [
    ("s3://models/smollm2", "models", "smollm2", "s3://models/smollm2"),
    ("s3://models/team/llama/", "models", "team/llama", "s3://models/team/llama"),
    ("s3://my.bucket-1", "my.bucket-1", "", "s3://my.bucket-1"),
])
def test_s3_uris_parse(uri, bucket, prefix, normalised):
    assert parse_remote(uri) == S3Source(bucket, prefix, normalised)


@pytest.mark.parametrize("uri, says", [
    ("hf://justaname", "org/name"),
    ("hf://org/na me", "org/name"),
    ("hf://org/name@", "revision"),
    ("hf://org/name/../x.gguf", "plain relative path"),
    ("hf://org--x/name", "org/name"),
    ("s3://Bad_Bucket/x", "bucket"),
    ("s3://ab/x", "bucket"),
    ("s3://bucket/a//b", "empty"),
    ("gs://bucket/x", "remote"),
])
def test_bad_uris_name_the_rule(uri, says):
    with pytest.raises(ModelSourceError, match=says):
        parse_remote(uri)


def test_is_remote():
    assert is_remote("hf://a/b") and is_remote("s3://bucket/x")
    assert not is_remote("hf-dir:/models/x") and not is_remote("random:tiny")


def test_cache_folders_are_readable_and_distinct():
    names = {cache_subdir(parse_remote(u)) for u in
             ("hf://org/name", "hf://org/name@main", "hf://org/name@v2", "hf://org/name/a.gguf", "s3://org/name",
              "s3://bucket/a/b", "s3://bucket/a--b")}
    assert len(names) == 6  # hf://org/name and hf://org/name@main are the same source
    assert cache_subdir(parse_remote("hf://org/name@v2")).startswith("hf/org--name@v2-")
    assert cache_subdir(parse_remote("s3://bucket/a/b")).startswith("s3/bucket--a--b-")


def test_a_hf_folder_takes_only_what_the_loader_reads():
    names = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "pytorch_model.bin",
             "README.md", "original/consolidated.00.pth", "onnx/model.onnx", "model.gguf"]
    assert select_model_files(names, "hf://o/n") == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]


def test_gguf_sources_need_exactly_one_file_or_a_name():
    assert select_model_files(["README.md", "m.Q8_0.gguf"], "s3://b/p") == ["m.Q8_0.gguf"]
    with pytest.raises(ModelNotFoundError, match="2 .gguf files.*name one"):
        select_model_files(["m.Q4_0.gguf", "m.Q8_0.gguf"], "hf://o/n")
    assert select_model_files(["m.Q4_0.gguf", "m.Q8_0.gguf"], "hf://o/n", "m.Q8_0.gguf") == ["m.Q8_0.gguf"]
    with pytest.raises(ModelNotFoundError, match="no file 'x.gguf'"):
        select_model_files(["m.Q4_0.gguf"], "hf://o/n", "x.gguf")
    with pytest.raises(ModelNotFoundError, match="not a model.*README.md"):
        select_model_files(["README.md", "pytorch_model.bin", "config.json"], "hf://o/n")


def test_local_spec_of_a_downloaded_folder(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"x")
    assert local_model_spec(tmp_path) == f"gguf:{tmp_path / 'm.gguf'}"
    (tmp_path / "config.json").write_text("{}")
    assert local_model_spec(tmp_path) == f"hf-dir:{tmp_path}"


def _partial_with(root, files: dict[str, bytes]):
    partial = new_partial(root)
    for name, data in files.items():
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_bytes(data)
    return partial


def test_publish_is_atomic_and_the_marker_checks_sizes(tmp_path):
    dest = tmp_path / "hf" / "o--n@main-x"
    marker = Marker("hf://o/n@main", "abc", [RemoteFile("config.json", 2, "e1"), RemoteFile("sub/w.safetensors", 3)])
    partial = _partial_with(tmp_path, {"config.json": b"{}", "sub/w.safetensors": b"abc"})
    assert publish(partial, dest, marker) == dest and not partial.exists()
    assert read_complete(dest, "hf://o/n@main") == marker
    assert read_complete(dest, "hf://o/n@v2") is None  # another source's marker is not this one's
    (dest / "sub" / "w.safetensors").write_bytes(b"ab")  # truncated behind our back
    assert read_complete(dest, "hf://o/n@main") is None


def test_publish_refuses_a_short_download(tmp_path):
    marker = Marker("s3://b/p", None, [RemoteFile("m.gguf", 10)])
    with pytest.raises(ModelNotFoundError, match="m.gguf arrived with 3 bytes, the source lists 10"):
        publish(_partial_with(tmp_path, {"m.gguf": b"abc"}), tmp_path / "s3" / "d", marker)
    assert not (tmp_path / "s3" / "d").exists()


def test_two_fetches_racing_keep_one_complete_copy(tmp_path):
    dest = tmp_path / "s3" / "d"
    marker = Marker("s3://b/p", None, [RemoteFile("m.gguf", 3)])
    first = _partial_with(tmp_path, {"m.gguf": b"abc"})
    second = _partial_with(tmp_path, {"m.gguf": b"xyz"})
    publish(first, dest, marker)
    assert publish(second, dest, marker) == dest
    assert (dest / "m.gguf").read_bytes() == b"abc" and not second.exists()


def test_an_incomplete_folder_under_the_final_name_is_replaced(tmp_path):
    dest = tmp_path / "s3" / "d"
    dest.mkdir(parents=True)
    (dest / "m.gguf").write_bytes(b"a")  # e.g. copied in by hand, no marker
    marker = Marker("s3://b/p", None, [RemoteFile("m.gguf", 3)])
    publish(_partial_with(tmp_path, {"m.gguf": b"abc"}), dest, marker)
    assert read_complete(dest, "s3://b/p") == marker
    assert sorted(p.name for p in dest.parent.iterdir()) == ["d"]


def test_crashed_downloads_are_cleared_a_day_later(tmp_path):
    crashed = _partial_with(tmp_path, {"m.gguf": b"ab"})
    live = _partial_with(tmp_path, {"m.gguf": b"a"})
    day_ago = crashed.stat().st_mtime - STALE_PARTIAL_SECONDS - 1
    os.utime(crashed, (day_ago, day_ago))
    fresh = new_partial(tmp_path)
    assert not crashed.exists() and live.exists() and fresh.exists()

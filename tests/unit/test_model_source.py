"""The shared model-source syntax (metronome.contract.model_source): one parser for `--model` and
spec.model.source, pure, and each side's own rules on top (the loader's files, the operator's mounts)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from metronome.contract.errors import ModelNotFoundError
from metronome.contract.model_source import (
    DEFAULT,
    PATH,
    SCHEMES,
    ModelSource,
    ModelSourceError,
    parse_model_source,
    syntax,
)
from metronome.operator.spec import SpecError, parse_source


@pytest.mark.parametrize("text,expected", [
    ("default", ModelSource(DEFAULT)),
    ("random:tiny", ModelSource("random", "tiny")),
    ("gguf:/m/a.gguf", ModelSource("gguf", "/m/a.gguf")),
    ("gguf:rel/a.gguf", ModelSource("gguf", "rel/a.gguf")),
    ("hf-dir:/m/llama", ModelSource("hf-dir", "/m/llama")),
    ("pvc:weights", ModelSource("pvc", "", claim="weights")),
    ("pvc:weights/llama/", ModelSource("pvc", "llama", claim="weights")),
    ("/m/a.gguf", ModelSource(PATH, "/m/a.gguf")),
    ("gs://bucket/x", ModelSource(PATH, "gs://bucket/x")),  # no such scheme (yet): a path, which nothing has
    ("hf://org/name", ModelSource("hf", "hf://org/name@main")),
    ("s3://bucket/x/", ModelSource("s3", "s3://bucket/x")),
])
def test_sources_parse(text, expected):
    assert parse_model_source(text) == expected


@pytest.mark.parametrize("text,why", [("", "non-empty"), ("random:", "preset"), ("gguf:", "path"),
                                      ("hf-dir:", "path"), ("pvc:Bad_Claim", "claim"), (None, "non-empty")])
def test_bad_sources_say_why(text, why):
    with pytest.raises(ModelSourceError, match=why):
        parse_model_source(text)


def test_each_side_lists_what_it_accepts():
    assert syntax("operator") == ("default, random:<preset>, gguf:<file.gguf>, hf-dir:<folder>, pvc:<claim>[/<path>], "
                                  "hf://<org>/<name>[/<file>][@<revision>], s3://<bucket>[/<prefix>]")
    assert "pvc" not in syntax("server") and "a .gguf file or model folder" in syntax("server")
    assert all(scheme.kind == kind and scheme.prefix.startswith(kind) for kind, scheme in SCHEMES.items())
    with pytest.raises(ValueError):
        syntax("client")


@pytest.mark.parametrize("text,field_message", [
    ("hf-dir:models/x", "absolute path"), ("/m/a.gguf", "is not one of default, random:<preset>"),
    ("pvc:Bad", "valid claim name"), ("", "non-empty"),
])
def test_the_operator_names_the_field(text, field_message):
    with pytest.raises(SpecError, match=rf"^spec\.model\.source: .*{field_message}"):
        parse_source(text)


def test_the_server_refuses_operator_only_sources_with_a_reason():
    from metronome.server.models.loader import parse_model_spec

    with pytest.raises(ModelNotFoundError, match="source for the operator"):
        parse_model_spec("pvc:weights/x")
    with pytest.raises(ModelNotFoundError, match="preset"):
        parse_model_spec("random:")
    assert parse_model_spec("random:tiny").target == "tiny"


def test_the_contract_is_light():
    probe = ("import sys, metronome.contract.model_source; "
             "print(sorted(m for m in sys.modules if m in ('torch', 'pydantic') or m.startswith('metronome.server')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

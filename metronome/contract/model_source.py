"""The model-source syntax, parsed once for both halves: `spec.model.source` of an InferenceService and `--model`
of `metronome serve|generate|bench`. Pure (no torch, no filesystem): what the string says, not whether it exists.

source                    kind      value                          accepted by
default                   default   ""                             server, operator
random:<preset>           random    the preset name                server, operator
gguf:<file.gguf>          gguf      the path                       server, operator (absolute: a hostPath)
hf-dir:<folder>           hf-dir    the path                       server, operator (absolute: a hostPath)
pvc:<claim>[/<path>]      pvc       the path inside the claim      operator (it mounts the claim, the server
                                    (`claim` holds the claim)      gets a path)
hf://<org>/<name>[/<file>][@<revision>]   hf   the normalised URI  server (downloads into its model cache),
s3://<bucket>[/<prefix>]  s3        the normalised URI             operator (an init container downloads into a
                                                                   cache volume); metronome.contract.remote_source
                                                                   parses both and names their cache folders
anything else             path      the text itself                server (a local .gguf file or model folder)

A new scheme is one entry in SCHEMES: its prefix, the syntax that messages show, a parser for what follows the
prefix, and the sides that accept it.
Errors never name a field: each side says which field or flag the text came from.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from metronome.contract.errors import MetronomeError

DEFAULT = "default"
PATH = "path"  # no scheme: a local path, decided by what exists (server only)

_CLAIM = re.compile(r"^(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(/(?P<path>.*))?$")  # a DNS-1123 label


class ModelSourceError(MetronomeError, ValueError):
    """The text is not a model source; the message says why, and the caller names the field or flag."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # a Scheme.kind, DEFAULT or PATH
    value: str = ""  # preset, path, or path inside the claim
    claim: str = ""  # pvc only


@dataclass(frozen=True)
class Scheme:
    kind: str
    prefix: str  # what the text starts with
    syntax: str  # as messages and docs show it
    parse: Callable[[str], ModelSource]  # the text after the prefix → a source; raises ModelSourceError
    server: bool = True  # `--model` accepts it
    operator: bool = True  # spec.model.source accepts it


def _needs_text(kind: str, what: str) -> Callable[[str], ModelSource]:
    def parse(rest: str) -> ModelSource:
        if not rest:
            raise ModelSourceError(f"{kind}: needs {what}")
        return ModelSource(kind, value=rest)

    return parse


def _pvc(rest: str) -> ModelSource:
    match = _CLAIM.match(rest)
    if not match:
        raise ModelSourceError(f"pvc:{rest} is not pvc:<claim>[/<path>] with a valid claim name")
    return ModelSource("pvc", value=(match.group("path") or "").strip("/"), claim=match.group("claim"))


def _remote(prefix: str) -> Callable[[str], ModelSource]:
    def parse(rest: str) -> ModelSource:
        from metronome.contract.remote_source import parse_remote  # it imports ModelSourceError from here

        return ModelSource(prefix.split(":")[0], value=parse_remote(prefix + rest).uri)

    return parse


SCHEMES: dict[str, Scheme] = {s.kind: s for s in (
    Scheme("random", "random:", "random:<preset>", _needs_text("random", "a preset name")),
    Scheme("gguf", "gguf:", "gguf:<file.gguf>", _needs_text("gguf", "a path")),
    Scheme("hf-dir", "hf-dir:", "hf-dir:<folder>", _needs_text("hf-dir", "a path")),
    Scheme("pvc", "pvc:", "pvc:<claim>[/<path>]", _pvc, server=False),
    Scheme("hf", "hf://", "hf://<org>/<name>[/<file>][@<revision>]", _remote("hf://")),
    Scheme("s3", "s3://", "s3://<bucket>[/<prefix>]", _remote("s3://")),
)}


def parse_model_source(text: str) -> ModelSource:
    """`text` → a ModelSource. No known prefix means a bare local path (kind PATH); only the server takes one."""
    if not isinstance(text, str) or not text:
        raise ModelSourceError("must be a non-empty string")
    if text == DEFAULT:
        return ModelSource(DEFAULT)
    for scheme in SCHEMES.values():
        if text.startswith(scheme.prefix):
            return scheme.parse(text[len(scheme.prefix):])
    return ModelSource(PATH, value=text)


def syntax(side: str) -> str:
    """The accepted forms for `side` ("server" or "operator"), for messages: 'default, random:<preset>, ...'."""
    if side not in ("server", "operator"):
        raise ValueError(f"side must be server or operator, got {side!r}")
    forms = [DEFAULT] + [s.syntax for s in SCHEMES.values() if getattr(s, side)]
    if side == "server":
        forms.append("a .gguf file or model folder")
    return ", ".join(forms)

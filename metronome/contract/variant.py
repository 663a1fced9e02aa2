"""Config variants: how one server pod of a service serves a candidate config while the others serve the control.

An experiment (operator/experiment/) runs a candidate scheduler config on a slice of a service's pods without
restarting any of them. Pod volumes cannot change on a running pod, but labels can, and the kubelet keeps a
downward-API projection of a pod's labels up to date at its periodic sync, as it does a ConfigMap's keys. So every
server pod mounts one projected volume holding
- `server.yaml`: the service's config (the control), from the ConfigMap `<name>-config`;
- `candidate.yaml`: the candidate config, from the ConfigMap `<name>-candidate-config` (optional: absent outside
  an experiment);
- `pod-labels`: the pod's own labels, in the kubelet's downward-API format;
and the server (`--candidate-config`, `--pod-labels`) serves `candidate.yaml` while its pod carries
`metronome.dev/variant=candidate` and that file exists, else `server.yaml`. The operator turns a pod into a
candidate and back by relabelling it; everything lands with the kubelet's one atomic `..data` swap of the volume.

Written once here for the server (which reads the files), the operator (which writes the labels and the pod
template) and the kubelet stand-in of the tests (which projects the labels as a kubelet does).
"""
from __future__ import annotations

from collections.abc import Mapping

LABEL = "metronome.dev/variant"
CANDIDATE = "candidate"
CONTROL = "control"
VARIANTS = (CONTROL, CANDIDATE)

CANDIDATE_CONFIG_FILE = "candidate.yaml"
POD_LABELS_FILE = "pod-labels"

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_UNESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r"}


def format_labels(labels: Mapping[str, str]) -> str:
    """A downward-API `metadata.labels` file as the kubelet writes it: one `key="value"` line per label, keys
    sorted, values quoted as Go's %q does for the characters a label value may hold, no trailing newline."""
    return "\n".join(f'{key}="{_quote(str(labels[key]))}"' for key in sorted(labels))


def _quote(value: str) -> str:
    return "".join(_ESCAPES.get(char, char) for char in value)


def parse_labels(text: str) -> dict[str, str]:
    """The labels of a downward-API file. Lines that are not `key="value"` are skipped: a half-written or foreign
    file must not take the server's config down, it only reads as "no labels"."""
    labels = {}
    for line in text.splitlines():
        key, sep, quoted = line.partition("=")
        if not sep or len(quoted) < 2 or not (quoted.startswith('"') and quoted.endswith('"')):
            continue
        value = _unquote(quoted[1:-1])
        if value is not None and key.strip():
            labels[key.strip()] = value
    return labels


def _unquote(body: str) -> str | None:
    out, index = [], 0
    while index < len(body):
        char = body[index]
        if char == "\\":
            if index + 1 >= len(body) or body[index + 1] not in _UNESCAPES:
                return None
            out.append(_UNESCAPES[body[index + 1]])
            index += 2
            continue
        out.append(char)
        index += 1
    return "".join(out)


def variant_of(labels: Mapping[str, str]) -> str:
    """CANDIDATE when the pod is labelled so, else CONTROL (no label, or any other value)."""
    return CANDIDATE if labels.get(LABEL) == CANDIDATE else CONTROL

"""Pure: does a child as it is in the cluster still match what the operator would write?

A child carries the fingerprint of the object the operator last wrote (annotation ANNOTATION_APPLIED): a
different fingerprint means the desired object changed (including a field the operator stopped setting, which
server-side apply then removes). An equal fingerprint is not enough: someone may have edited or removed a field
the operator sets (`kubectl scale deployment`, `kubectl edit service`), so every field of the desired object must
also read the same in the cluster (`contains`). Fields the API server or others add are not the operator's and
are ignored.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

ANNOTATION_APPLIED = "metronome.dev/applied"


def fingerprint(obj: Mapping[str, Any]) -> str:
    """A short digest of a desired object (its own fingerprint annotation left out)."""
    data = json.loads(json.dumps(obj, sort_keys=True, default=str))
    annotations = (data.get("metadata") or {}).get("annotations") or {}
    annotations.pop(ANNOTATION_APPLIED, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def stamped(obj: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` with its fingerprint annotation."""
    out = dict(obj)
    metadata = dict(out.get("metadata") or {})
    metadata["annotations"] = {**(metadata.get("annotations") or {}), ANNOTATION_APPLIED: fingerprint(obj)}
    out["metadata"] = metadata
    return out


_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
_SUFFIX = {None: 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3, "M": 10**6,
           "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
           "Pi": 2**50, "Ei": 2**60}


def _quantity(text: str) -> Decimal | None:
    match = _QUANTITY.match(text)
    return Decimal(match.group(1)) * _SUFFIX[match.group(2)] if match else None


def _same_scalar(actual: Any, desired: Any) -> bool:
    if isinstance(desired, bool) or isinstance(actual, bool):
        return actual is desired
    if isinstance(desired, str) and isinstance(actual, str) and actual != desired:
        # The API server writes quantities in its canonical form ("0.5" is stored as "500m").
        ours, theirs = _quantity(desired), _quantity(actual)
        return ours is not None and ours == theirs
    return actual == desired


def _zero(value: Any) -> bool:
    """A value the API server leaves out when it stores an object (`readOnly: false`, an empty map)."""
    return value is False or value == 0 or value in ("", None) or value == {} or value == []


def contains(actual: Any, desired: Any) -> bool:
    """Every field `desired` sets has that value in `actual`. Maps: the desired keys (a zero value may be left
    out). Lists of objects (containers, ports, env: merged by key under server-side apply): every desired item is
    in the list, and items others added are theirs. Other lists (args, command): equal."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            contains(actual[key], value) if key in actual else _zero(value) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list):
            return False
        if desired and all(isinstance(item, Mapping) for item in desired):
            return all(any(contains(a, d) for a in actual) for d in desired)
        return len(actual) == len(desired) and all(contains(a, d) for a, d in zip(actual, desired))
    return _same_scalar(actual, desired)


def needs_write(actual: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """`desired` (stamped) differs from what the cluster holds: missing, another fingerprint, or a field edited."""
    if actual is None:
        return True
    applied = ((actual.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_APPLIED)
    wanted = ((desired.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_APPLIED)
    return applied != wanted or not contains(actual, desired)

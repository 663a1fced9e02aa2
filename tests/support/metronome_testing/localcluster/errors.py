"""Typed errors of the local control plane."""


class ClusterError(Exception):
    """Base class: something about the local cluster went wrong."""


class ToolsMissingError(ClusterError):
    """Go-built binaries are missing and were not (or could not be) built."""

    def __init__(self, missing: list[str], detail: str = ""):
        self.missing = missing
        text = "missing tools: " + ", ".join(missing) + " (build them with `make tools` / hack/build-tools.sh)"
        super().__init__(text + (f"; {detail}" if detail else ""))


class ClusterStartError(ClusterError):
    """A component did not start or did not become ready; the message names it and its log."""

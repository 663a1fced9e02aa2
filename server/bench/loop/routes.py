"""Where the loop benchmark's load goes while the servers change: a small JSON file listing the live servers'
base URLs, rewritten atomically (write aside, rename) by the run that starts and stops them, and re-read by every
client process when it changes (a stat per request, a read per change). What a Service's endpoints are to a
pod's clients: a server leaves the list before it is stopped, so no new request reaches a draining server.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path


def write_routes(path: str | Path, urls: Sequence[str]) -> None:
    path = Path(path)
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_text(json.dumps(list(urls)))
    os.replace(aside, path)


class Routes:
    """The live URLs from a routes file, re-read only when the file changed; the last good list while it cannot
    be read (never an empty list once one was read)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._urls: list[str] = []

    def urls(self) -> list[str]:
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_ino)
            if stamp != self._stamp:
                urls = json.loads(self.path.read_text())
                if isinstance(urls, list) and urls and all(isinstance(u, str) for u in urls):
                    self._urls, self._stamp = urls, stamp
        except (OSError, ValueError):
            pass
        return self._urls

"""A minimal HTTPS client for the local API server (mutual TLS with the admin certificate).

Used only while bringing the cluster up (readiness, fake nodes); tests use kubectl.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

from .pki import Pki


@dataclass(frozen=True)
class ApiResponse:
    status: int
    body: str

    def json(self) -> dict:
        return json.loads(self.body)


class ApiClient:
    def __init__(self, api_url: str, pki: Pki, timeout_s: float = 5.0):
        self.api_url = api_url.rstrip("/")
        self.timeout_s = timeout_s
        self._context = ssl.create_default_context(cafile=str(pki.ca_cert))
        self._context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        # No proxy ever: the API server is on loopback.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                                   urllib.request.HTTPSHandler(context=self._context))

    def request(self, method: str, path: str, body: dict | None = None) -> ApiResponse:
        """Returns the status and body for any HTTP answer; raises OSError when nothing answers."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.api_url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return ApiResponse(resp.status, resp.read().decode())
        except urllib.error.HTTPError as error:
            return ApiResponse(error.code, error.read().decode(errors="replace"))

    def get(self, path: str) -> ApiResponse:
        return self.request("GET", path)

    def create(self, path: str, body: dict) -> ApiResponse:
        return self.request("POST", path, body)

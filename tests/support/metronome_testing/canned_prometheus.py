"""A Prometheus stand-in with canned readings: a small /api/v1/query server on 127.0.0.1 that answers each query of
the operator's metrics source (recognised by its exact PromQL, metrics_source.build_queries) from `state`, for the
services it was told about. The operator's real path (PrometheusMetricsSource → controller → ConfigMap, status,
Events) then runs on readings a test sets; a service names it in spec.metrics.prometheusUrl (the operator's
--allow-prometheus-url must admit `url`).

    fake = CannedPrometheus("ns", ("tuned",), window_s=10); fake.failing = False
    fake.state.update(tbt_p99_s=0.09, generations={"p0": 1}); ...; fake.close()
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from metronome.operator import metrics_source as ms


class CannedPrometheus:
    """Answers from `state` (tbt_p99_s, samples, tokens_per_s, generations: pod → generation); `failing` makes
    every query a 500. Queries it does not know (other services, step samples, queues) get an empty result."""

    def __init__(self, namespace: str, services: Iterable[str], window_s: float):
        window = ms.QueryWindow.for_window(window_s)
        self.key_of = {query: key for name in services
                       for key, query in ms.build_queries(ms.ServiceSelector(namespace, name), window).items()}
        self.state: dict[str, Any] = {"tbt_p99_s": 0.060, "samples": 5000, "tokens_per_s": 900.0,
                                      "generations": {"p0": 1, "p1": 1}}
        self.failing = True
        self.queries = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                url = urlparse(self.path)
                query = parse_qs(url.query).get("query", [""])[0]
                fake.queries += 1
                if url.path != "/api/v1/query" or fake.failing:
                    return self._send(500, {"status": "error", "error": "canned failure"})
                result = fake.result(fake.key_of.get(query))
                self._send(200, {"status": "success", "data": {"resultType": "vector", "result": result}})

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def result(self, key: str | None) -> list[dict]:
        def scalar(value: float) -> list[dict]:
            return [{"metric": {}, "value": [0, repr(float(value))]}]

        state = self.state
        scalars = {ms.TBT_P99: state["tbt_p99_s"], ms.TBT_COUNT: state["samples"],
                   ms.TTFT_P99: 0.2, ms.OUTPUT_TOKENS_RATE: state["tokens_per_s"]}
        if key in scalars:
            return scalar(scalars[key])
        if key == ms.GENERATION_BY_POD:
            return [{"metric": {"pod": pod}, "value": [0, str(g)]} for pod, g in state["generations"].items()]
        return []  # no step samples, queues, ...: the multiplicative policy needs none

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

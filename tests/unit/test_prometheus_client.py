"""The operator's Prometheus client settings (operator/metrics_source.py): the allow-list for per-resource URLs,
the bearer token and TLS, and error messages that never carry the answer's body."""
from __future__ import annotations

import http.server
import threading

import pytest

from metronome.operator.metrics_source import (
    MetricsUnavailable,
    PrometheusSettings,
    QueryWindow,
    ServiceSelector,
    normalize_url,
)

OWN = "http://prometheus.monitoring:9090"


def test_only_the_operators_own_url_and_the_allow_list_are_admitted():
    settings = PrometheusSettings(url=OWN, allowed_urls=("https://team-prom.ml/prom/",))
    assert settings.resolve_url(None) == OWN
    assert settings.resolve_url("HTTP://Prometheus.Monitoring:9090/") == OWN  # the same URL, written otherwise
    assert settings.resolve_url("https://team-prom.ml:443/prom") == "https://team-prom.ml/prom"
    for refused in ("http://kubernetes.default:443", "http://prometheus.monitoring:9091", "http://169.254.169.254/",
                    "file:///etc/passwd", "http://user:pw@prometheus.monitoring:9090"):
        with pytest.raises(MetricsUnavailable) as exc:
            settings.resolve_url(refused)
        assert exc.value.reason == MetricsUnavailable.URL_NOT_ALLOWED
    assert PrometheusSettings().resolve_url(None) is None
    with pytest.raises(MetricsUnavailable, match="allow-list"):
        PrometheusSettings().resolve_url(OWN)  # no operator URL: nothing at all is admitted


def test_the_token_is_read_at_each_reading_and_a_missing_one_is_a_clear_problem(tmp_path):
    token = tmp_path / "token"
    token.write_text("first\n")
    settings = PrometheusSettings(url=OWN, bearer_token_file=str(token))
    assert settings.headers() == {"Authorization": "Bearer first"}
    token.write_text("rotated")
    assert settings.headers() == {"Authorization": "Bearer rotated"}
    token.unlink()
    with pytest.raises(MetricsUnavailable, match="bearer token file") as exc:
        settings.headers()
    assert exc.value.reason == MetricsUnavailable.CREDENTIALS


def test_tls_verification_is_on_unless_skipped_explicitly():
    assert PrometheusSettings().verify() is True
    assert PrometheusSettings(ca_file="/ca.pem").verify() == "/ca.pem"
    assert PrometheusSettings(insecure_skip_verify=True).verify() is False
    with pytest.raises(ValueError):
        PrometheusSettings(ca_file="/ca.pem", insecure_skip_verify=True)
    with pytest.raises(ValueError):
        normalize_url("prometheus:9090")


def test_windows_span_four_scrape_intervals():
    assert PrometheusSettings(scrape_interval_seconds=30).window(60) == QueryWindow(120.0, 120.0)
    assert PrometheusSettings().window(60) == QueryWindow(60.0, 15.0)


SECRET = "internal-admin-panel: password=hunter2"


@pytest.fixture
def refusing_server():
    """Answers every request 403 with a body that must never reach a condition; records the headers."""
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(dict(self.headers))
            body = SECRET.encode()
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", seen
    server.shutdown()
    server.server_close()


def test_a_refusal_is_summarised_by_status_never_echoed(refusing_server, tmp_path):
    url, seen = refusing_server
    token = tmp_path / "token"
    token.write_text("s3cret-token")
    source = PrometheusSettings(url=url, bearer_token_file=str(token)).source_for(url)
    try:
        with pytest.raises(MetricsUnavailable) as exc:
            source.observe(ServiceSelector("ns", "svc"), QueryWindow(60, 15))
    finally:
        source.close()
    assert exc.value.reason == MetricsUnavailable.UNAUTHORIZED
    assert exc.value.message == f"Prometheus at {url} answered HTTP 403 Forbidden"
    assert "hunter2" not in str(exc.value) and "s3cret" not in str(exc.value)
    assert seen[0]["Authorization"] == "Bearer s3cret-token"

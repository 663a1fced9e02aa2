"""Where the controller's Observation comes from: PromQL over the servers' own metrics.

Three layers, so that everything but the HTTP call is testable without Prometheus:
- `build_queries(selector, window)` — pure: the PromQL, built only from `metronome.contract.metric_names`;
- `observation_from_results(results, window)` — pure: Prometheus' JSON `result` lists → Observation;
- `PrometheusMetricsSource.observe(...)` — the I/O, through `prometheus-api-client`, every failure turned into
  `MetricsUnavailable` with a condition-ready reason.

Label contract: a service's series are matched by `model` (the server sets it itself on every series: its
`--served-model-name`, which the operator makes the InferenceService's name) and `namespace` (which every stock
discovery attaches: prometheus-operator's PodMonitor and ServiceMonitor, and the usual `kubernetes_sd_configs`
pod job), plus `pod` (or at least `instance`) to tell pods apart. So annotation-based discovery, a PodMonitor
and a ServiceMonitor all work without relabelling of ours. `POD_RELABELING` states the namespace/pod labels as
relabeling rules from Kubernetes service discovery (rendered for the PodMonitor below; hack/standin writes the
same labels, with `service` as an extra for people reading the series). The label names are fields of
`ServiceSelector`, so another scrape setup only needs another selector.

Client (`PrometheusSettings`): the operator's own URL, an allow-list for per-resource URLs
(`spec.metrics.prometheusUrl`), a bearer token file (re-read at every reading: projected tokens rotate), a CA
file or an opt-in to skip TLS verification, and the scrape interval the rate windows must cover. A remote
error is summarised (status code and reason), never echoed: a condition message is readable by anyone who may
read the resource.

What policy switching reads comes from the server's prompt lanes (a prompt is short when it has at most the
scheduler's short_prompt_threshold tokens): the long-prompt share is long / all of `metronome_prompts_total{lane}`
over the window, and short requests' p99 TBT is the TBT histogram's `lane="short"` series. The step-time fit gets
one point per pod, step kind (decode / mixed) and sub-window. The settling window reads each pod's
`metronome_config_applied_timestamp_seconds`; the prefill guard reads the waiting queue (its mean over the window)
and its growth.
"""
from __future__ import annotations

import http
import math
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from metronome.contract import metric_names as names
from metronome.operator.tuning.observation import MetricsUnavailable, Observation, StepSample

# Keys of build_queries' result; one PromQL expression each.
TBT_P99 = "tbt_p99"
TBT_COUNT = "tbt_count"
TTFT_P99 = "ttft_p99"
OUTPUT_TOKENS_RATE = "output_tokens_rate"
PROMPT_TOKENS_RATE = "prompt_tokens_rate"
REQUESTS_RATE = "requests_rate"
RUNNING_PER_POD = "running_per_pod"
STEP_TOKENS_RATE = "step_tokens_rate"
STEP_SECONDS_RATE = "step_seconds_rate"
STEP_COUNT_RATE = "step_count_rate"
GENERATION_BY_POD = "generation_by_pod"
TBT_P99_BY_LANE = "tbt_p99_by_lane"
PROMPTS_BY_LANE = "prompts_by_lane"
APPLIED_BY_POD = "applied_by_pod"
WAITING = "waiting"
WAITING_GROWTH = "waiting_growth"
PREFILLING = "prefilling"
QUERY_KEYS = (TBT_P99, TBT_COUNT, TTFT_P99, OUTPUT_TOKENS_RATE, PROMPT_TOKENS_RATE, REQUESTS_RATE,
              RUNNING_PER_POD, STEP_TOKENS_RATE, STEP_SECONDS_RATE, STEP_COUNT_RATE, GENERATION_BY_POD,
              TBT_P99_BY_LANE, PROMPTS_BY_LANE, APPLIED_BY_POD, WAITING, WAITING_GROWTH, PREFILLING)


# The scrape-side half of the label contract, as relabeling rules from Kubernetes service discovery (role: pod)
# to series labels: what prometheus-operator and the usual pod jobs attach anyway. `model` needs none: the
# server sets it.
POD_RELABELING = (
    ("__meta_kubernetes_namespace", "namespace"),
    ("__meta_kubernetes_pod_name", "pod"),
)


def podmonitor_relabelings() -> list[dict[str, Any]]:
    """`spec.podMetricsEndpoints[].relabelings` of a PodMonitor (prometheus-operator) that meets the contract."""
    return [{"sourceLabels": [source], "targetLabel": target, "action": "replace"} for source, target in POD_RELABELING]


@dataclass(frozen=True)
class ServiceSelector:
    """Selects one InferenceService's server series in Prometheus."""

    namespace: str
    service: str
    namespace_label: str = "namespace"
    service_label: str = names.MODEL_LABEL  # the server's own label: --served-model-name = the service's name
    pod_label: str = "pod"
    instance_label: str = "instance"

    def __post_init__(self) -> None:
        if not self.namespace or not self.service:
            raise ValueError(f"ServiceSelector needs a namespace and a service, got "
                             f"{self.namespace!r}/{self.service!r}")
        for label in (self.namespace_label, self.service_label, self.pod_label, self.instance_label):
            if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", label):
                raise ValueError(f"not a Prometheus label name: {label!r}")

    def matchers(self) -> str:
        return (f'{{{self.namespace_label}="{_escape(self.namespace)}",'
                f'{self.service_label}="{_escape(self.service)}"}}')


MIN_SCRAPES_PER_RANGE = 4  # every rate() range spans at least this many scrape intervals


@dataclass(frozen=True)
class QueryWindow:
    """`window_seconds`: what one observation covers. `sub_window_seconds`: the slices that give the step-time
    fit its points; keep it at least 4 scrape intervals so that each rate() has samples."""

    window_seconds: float = 60.0
    sub_window_seconds: float = 15.0

    def __post_init__(self) -> None:
        if not (self.sub_window_seconds >= 1 and self.window_seconds >= self.sub_window_seconds):
            raise ValueError(f"need 1 s <= sub-window <= window, got {self.sub_window_seconds} s and "
                             f"{self.window_seconds} s")

    @classmethod
    def for_window(cls, window_seconds: float, sub_window_seconds: float | None = None,
                   scrape_interval_seconds: float | None = None) -> QueryWindow:
        """A window (e.g. spec.metrics.windowSeconds) with its sub-window: by default a quarter of the window
        (a 60 s window gives the step fit 4 points per pod). With a known scrape interval every range — the
        window and the sub-window — spans at least 4 scrape intervals (a rate() needs two samples in its range,
        and a late scrape must not empty it): a 30 s scrape interval widens a 60 s window to 2 min, and a 0.5 s
        one lets a 6 s window have 3 points. Without one the sub-window is at least 5 s, a guess that holds
        for the fast scrapes short windows come with."""
        window = parse_duration(window_seconds, "spec.metrics.windowSeconds")
        scrape = parse_duration(scrape_interval_seconds, "scrape interval") if scrape_interval_seconds else 0.0
        window = max(window, MIN_SCRAPES_PER_RANGE * scrape)
        if sub_window_seconds is None:
            sub_window_seconds = max(window / 4, MIN_SCRAPES_PER_RANGE * scrape if scrape else 5.0)
        return cls(window, min(parse_duration(sub_window_seconds, "sub-window"), window))


class MetricsSource(Protocol):
    def observe(self, selector: ServiceSelector, window: QueryWindow, now: float | None = None) -> Observation:
        """One observation of one service; raises MetricsUnavailable when Prometheus cannot give one."""
        ...


def try_observe(source: MetricsSource, selector: ServiceSelector, window: QueryWindow,
                now: float | None = None) -> tuple[Observation | None, MetricsUnavailable | None]:
    """(observation, None) or (None, why): the handler's one call."""
    try:
        return source.observe(selector, window, now), None
    except MetricsUnavailable as exc:
        return None, exc


# --- pure: PromQL --------------------------------------------------------------------------------------------

def build_queries(selector: ServiceSelector, window: QueryWindow) -> dict[str, str]:
    m = selector.matchers()
    w = format_duration(window.window_seconds)
    s = format_duration(window.sub_window_seconds)
    per_pod = f"{selector.pod_label}, {selector.instance_label}"
    tbt, ttft = names.TIME_BETWEEN_TOKENS, names.TIME_TO_FIRST_TOKEN

    def slices(series: str) -> str:
        # One point per pod and step kind per sub-window: a subquery of per-sub-window rates across the window.
        return f"(sum by ({per_pod}, {names.STEP_KIND_LABEL}) (rate({series}{m}[{s}])))[{w}:{s}]"

    return {
        TBT_P99: f"histogram_quantile(0.99, sum by (le) (rate({tbt}_bucket{m}[{w}])))",
        TBT_COUNT: f"sum(increase({tbt}_count{m}[{w}]))",
        TTFT_P99: f"histogram_quantile(0.99, sum by (le) (rate({ttft}_bucket{m}[{w}])))",
        OUTPUT_TOKENS_RATE: f"sum(rate({names.GENERATION_TOKENS}{m}[{w}]))",
        PROMPT_TOKENS_RATE: f"sum(rate({names.PROMPT_TOKENS}{m}[{w}]))",
        REQUESTS_RATE: f"sum(rate({names.REQUEST_E2E}_count{m}[{w}]))",
        RUNNING_PER_POD: f"avg(avg_over_time({names.REQUESTS_RUNNING}{m}[{w}]))",
        STEP_TOKENS_RATE: slices(f"{names.STEP_TOKENS}_sum"),
        STEP_SECONDS_RATE: slices(f"{names.STEP_DURATION}_sum"),
        STEP_COUNT_RATE: slices(f"{names.STEP_DURATION}_count"),
        GENERATION_BY_POD: f"max by ({per_pod}) ({names.CONFIG_GENERATION}{m})",
        TBT_P99_BY_LANE: f"histogram_quantile(0.99, sum by (le, {names.LANE_LABEL}) (rate({tbt}_bucket{m}[{w}])))",
        PROMPTS_BY_LANE: f"sum by ({names.LANE_LABEL}) (increase({names.PROMPTS}{m}[{w}]))",
        APPLIED_BY_POD: f"max by ({per_pod}) ({names.CONFIG_APPLIED_TIME}{m})",
        WAITING: f"sum(avg_over_time({names.REQUESTS_WAITING}{m}[{w}]))",
        WAITING_GROWTH: f"sum(delta({names.REQUESTS_WAITING}{m}[{w}]))",
        PREFILLING: f"sum(avg_over_time({names.REQUESTS_PREFILLING}{m}[{w}]))",
    }


# --- pure: results → Observation -----------------------------------------------------------------------------

def observation_from_results(results: Mapping[str, Any], window: QueryWindow,
                             selector: ServiceSelector | None = None) -> Observation:
    """Turn the `data.result` list of each query into an Observation. Raises MetricsUnavailable(NO_SERIES)
    when Prometheus has no series of this service at all, BAD_RESPONSE when a result is malformed.
    A service with series but no tokens in the window gives an Observation with sample_count 0."""
    missing = [key for key in QUERY_KEYS if key not in results]
    if missing:
        raise MetricsUnavailable(MetricsUnavailable.BAD_RESPONSE, f"results missing for {', '.join(missing)}")
    pod_label = selector.pod_label if selector else "pod"
    instance_label = selector.instance_label if selector else "instance"
    if all(not _as_list(results[key], key) for key in QUERY_KEYS):
        who = f"{selector.namespace}/{selector.service}" if selector else "the service"
        raise MetricsUnavailable(MetricsUnavailable.NO_SERIES,
                                 f"Prometheus has no Metronome series for {who}: is it scraping the pods?")

    def pod_of(metric: Mapping[str, str]) -> str:
        return metric.get(pod_label) or metric.get(instance_label) or ""

    sample_count = _scalar(results, TBT_COUNT)
    output_rate = _scalar(results, OUTPUT_TOKENS_RATE)
    prompt_rate = _scalar(results, PROMPT_TOKENS_RATE)
    requests_rate = _scalar(results, REQUESTS_RATE)
    mean_prompt = prompt_rate / requests_rate if prompt_rate is not None and requests_rate else None
    generations = {pod: int(value) for pod, value in _by_pod(results, GENERATION_BY_POD, pod_of).items()}
    applied = {pod: value for pod, value in _by_pod(results, APPLIED_BY_POD, pod_of).items() if value > 0}
    return Observation(
        window_seconds=window.window_seconds,
        sample_count=int(round(sample_count or 0.0)),
        tbt_p99_s=_positive(_scalar(results, TBT_P99)),
        ttft_p99_s=_positive(_scalar(results, TTFT_P99)),
        output_tokens_per_s=output_rate or 0.0,
        prompt_tokens_per_s=prompt_rate,
        requests_per_s=requests_rate,
        mean_prompt_tokens=mean_prompt,
        long_prompt_share=_long_share(results),
        short_tbt_p99_s=_positive(_by_lane(results, TBT_P99_BY_LANE).get(names.LANES[0])),
        decode_batch_size=_scalar(results, RUNNING_PER_POD),
        step_samples=_step_samples(results, window, pod_of),
        pod_generations=generations,
        config_applied_at=applied,
        waiting_requests=_scalar(results, WAITING),
        waiting_growth=_scalar(results, WAITING_GROWTH),
        prefilling_requests=_scalar(results, PREFILLING),
    )


def _by_pod(results: Mapping[str, Any], key: str, pod_of) -> dict[str, float]:
    out = {}
    for series in _as_list(results[key], key):
        value = _value(series, key)
        if value is not None:
            out[pod_of(series.get("metric", {}))] = value
    return out


def _by_lane(results: Mapping[str, Any], key: str) -> dict[str, float]:
    by_lane: dict[str, float] = {}
    for series in _as_list(results[key], key):
        value = _value(series, key)
        if value is not None:
            lane = series.get("metric", {}).get(names.LANE_LABEL, "")
            by_lane[lane] = by_lane.get(lane, 0.0) + value
    return by_lane


def _long_share(results: Mapping[str, Any]) -> float | None:
    """Long-lane prompts over all prompts in the window; None when no prompt arrived."""
    by_lane = _by_lane(results, PROMPTS_BY_LANE)
    total = sum(by_lane.values())
    return by_lane.get(names.LANES[1], 0.0) / total if total > 0 else None


def _step_samples(results: Mapping[str, Any], window: QueryWindow, pod_of) -> tuple[StepSample, ...]:
    def by_pod_and_time(key: str) -> dict[tuple[str, str, float], float]:
        points = {}
        for series in _as_list(results[key], key):
            metric = series.get("metric", {})
            pod, kind = pod_of(metric), metric.get(names.STEP_KIND_LABEL, "")
            values = series.get("values")
            if not isinstance(values, list):
                raise MetricsUnavailable(MetricsUnavailable.BAD_RESPONSE, f"{key}: expected a range vector")
            for point in values:
                timestamp, value = _point(point, key)
                if value is not None:
                    points[(pod, kind, timestamp)] = value
        return points

    tokens, seconds, counts = (by_pod_and_time(k) for k in (STEP_TOKENS_RATE, STEP_SECONDS_RATE, STEP_COUNT_RATE))
    samples = []
    for key in sorted(counts):
        steps_per_s = counts[key]
        if steps_per_s > 0 and key in tokens and key in seconds:
            samples.append(StepSample(tokens_per_step=tokens[key] / steps_per_s,
                                      step_seconds=seconds[key] / steps_per_s,
                                      steps=steps_per_s * window.sub_window_seconds, pod=key[0], kind=key[1]))
    return tuple(samples)


def _as_list(result: Any, key: str) -> list:
    if not isinstance(result, list):
        raise MetricsUnavailable(MetricsUnavailable.BAD_RESPONSE, f"{key}: expected a list of series, got "
                                                                  f"{type(result).__name__}")
    return result


def _point(point: Any, key: str) -> tuple[float, float | None]:
    try:
        timestamp, text = point
        value = float(text)
        return float(timestamp), (value if math.isfinite(value) else None)
    except (TypeError, ValueError) as exc:
        raise MetricsUnavailable(MetricsUnavailable.BAD_RESPONSE, f"{key}: malformed sample {point!r}") from exc


def _value(series: Any, key: str) -> float | None:
    if not isinstance(series, Mapping) or "value" not in series:
        raise MetricsUnavailable(MetricsUnavailable.BAD_RESPONSE, f"{key}: expected an instant vector")
    return _point(series["value"], key)[1]


def _scalar(results: Mapping[str, Any], key: str) -> float | None:
    """The value of a query that aggregates to one series; None when it has none or is NaN."""
    series = _as_list(results[key], key)
    return _value(series[0], key) if series else None


def _positive(value: float | None) -> float | None:
    return value if value is not None and value > 0 else None


# --- durations and label values ------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration(value: Any, where: str = "duration") -> float:
    """'90s', '2m', '1h', '500ms' or a number of seconds → seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(f"{where}: not a duration: {value!r} (use e.g. 60s, 2m)")
        scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]
        seconds = float(match.group(1)) * scale
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{where}: must be positive, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """PromQL duration: whole seconds, or milliseconds when the value has a fraction."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{int(round(seconds * 1000))}ms"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# --- the client's settings (pure) ---------------------------------------------------------------------------

def normalize_url(url: str, where: str = "Prometheus URL") -> str:
    """Scheme and host lower-cased, the default port and a trailing slash dropped: the form the allow-list
    compares. Raises ValueError for anything but http(s)://host[:port][/path] without credentials or query."""
    parsed = urllib.parse.urlsplit(str(url).strip())
    if parsed.scheme.lower() not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{where} must be http(s)://host[:port][/path], got {url!r}")
    if parsed.username or parsed.password or parsed.query or parsed.fragment:
        raise ValueError(f"{where} must carry no credentials, query or fragment, got {url!r}")
    scheme = parsed.scheme.lower()
    try:
        port = parsed.port
    except ValueError as exc:
        raise ValueError(f"{where} has a bad port: {url!r}") from exc
    host = parsed.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port in (None, {"http": 80, "https": 443}[scheme]) else f"{host}:{port}"
    return urllib.parse.urlunsplit((scheme, netloc, parsed.path.rstrip("/"), "", ""))


@dataclass(frozen=True)
class PrometheusSettings:
    """How the operator reaches Prometheus (from its flags; see docs/operator.md)."""

    url: str | None = None  # --prometheus-url: for every service without spec.metrics.prometheusUrl
    allowed_urls: tuple[str, ...] = ()  # --allow-prometheus-url: what spec.metrics.prometheusUrl may name
    bearer_token_file: str | None = None
    ca_file: str | None = None
    insecure_skip_verify: bool = False
    scrape_interval_seconds: float | None = None  # None: unknown (the operator's PodMonitors pick their own)
    timeout_seconds: float = 5.0

    def __post_init__(self) -> None:
        if self.url is not None:
            normalize_url(self.url, "--prometheus-url")
        for url in self.allowed_urls:
            normalize_url(url, "--allow-prometheus-url")
        if self.ca_file and self.insecure_skip_verify:
            raise ValueError("--prometheus-ca-file and --prometheus-insecure-skip-verify exclude each other")
        if self.scrape_interval_seconds is not None:
            parse_duration(self.scrape_interval_seconds, "--scrape-interval")

    def resolve_url(self, spec_url: str | None) -> str | None:
        """The URL to read one service from: its own spec.metrics.prometheusUrl when the allow-list (or the
        operator's own URL) admits it, else the operator's URL (None: none configured). Raises
        MetricsUnavailable(URL_NOT_ALLOWED) for a URL the operator was not told to trust: a namespace user
        must not make the operator send requests to, say, an internal service."""
        if not spec_url:
            return self.url
        try:
            wanted = normalize_url(spec_url, "spec.metrics.prometheusUrl")
        except ValueError as exc:
            raise MetricsUnavailable(MetricsUnavailable.URL_NOT_ALLOWED, str(exc)) from exc
        admitted = {normalize_url(url) for url in (*self.allowed_urls, *([self.url] if self.url else []))}
        if wanted not in admitted:
            raise MetricsUnavailable(
                MetricsUnavailable.URL_NOT_ALLOWED,
                f"spec.metrics.prometheusUrl {wanted} is not on the operator's allow-list "
                f"(metronome operator --allow-prometheus-url; chart value prometheus.allowedUrls)")
        return wanted

    def window(self, window_seconds: float) -> QueryWindow:
        return QueryWindow.for_window(window_seconds, scrape_interval_seconds=self.scrape_interval_seconds)

    def headers(self) -> dict[str, str]:
        """The Authorization header from the token file, read now (a projected token is rotated in place)."""
        if not self.bearer_token_file:
            return {}
        try:
            with open(self.bearer_token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise MetricsUnavailable(MetricsUnavailable.CREDENTIALS,
                                     f"cannot read the Prometheus bearer token file "
                                     f"{self.bearer_token_file}: {exc.strerror}") from exc
        if not token:
            raise MetricsUnavailable(MetricsUnavailable.CREDENTIALS,
                                     f"the Prometheus bearer token file {self.bearer_token_file} is empty")
        return {"Authorization": f"Bearer {token}"}

    def verify(self) -> bool | str:
        """requests' `verify`: the CA bundle, False when told to skip verification, else the system's CAs."""
        if self.insecure_skip_verify:
            return False
        return self.ca_file or True

    def source_for(self, url: str) -> PrometheusMetricsSource:
        return PrometheusMetricsSource(url, timeout_seconds=self.timeout_seconds, headers=self.headers(),
                                       verify=self.verify())


def summarize_http_error(status_code: int) -> str:
    """'HTTP 403 Forbidden': what a condition may say about a refused request (the body stays out)."""
    try:
        phrase = http.HTTPStatus(status_code).phrase
    except ValueError:
        phrase = "unknown status"
    return f"HTTP {status_code} {phrase}"


_STATUS_CODE = re.compile(r"HTTP Status Code (\d{3})")


# --- I/O -----------------------------------------------------------------------------------------------------

class PrometheusMetricsSource:
    """MetricsSource over Prometheus' HTTP API (prometheus-api-client). All queries of one observation are
    evaluated at the same instant (`now`, or Prometheus' own clock when None). `verify` is requests' own: True
    (system CAs), a CA bundle path, or False."""

    def __init__(self, url: str, timeout_seconds: float = 5.0, retries: int = 1,
                 headers: Mapping[str, str] | None = None, verify: bool | str = True):
        import requests
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        self.url = normalize_url(url)
        # Fail fast: a control loop would rather skip one interval than block on a sick Prometheus.
        retry = Retry(total=retries, connect=retries, read=False, status=retries, backoff_factor=0.2,
                      status_forcelist=(502, 503, 504), raise_on_status=False)
        session = requests.Session()
        session.verify = verify
        self._client = PrometheusConnect(url=self.url, headers=dict(headers) if headers else None,
                                         session=session, retry=retry, timeout=timeout_seconds)

    def observe(self, selector: ServiceSelector, window: QueryWindow, now: float | None = None) -> Observation:
        params = {"time": f"{now:.3f}"} if now is not None else {}
        results = {key: self._query(query, params) for key, query in build_queries(selector, window).items()}
        return observation_from_results(results, window, selector)

    def close(self) -> None:
        self._client.close()

    def range_query(self, query: str, start: float, end: float, step_seconds: float) -> Any:
        """One range query (Unix times; the points at start, start + step, ... up to end); failures as _query's."""
        import datetime as dt

        def when(t: float) -> dt.datetime:
            return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc)

        return self._answer(lambda: self._client.custom_query_range(query, when(start), when(end),
                                                                    format_duration(step_seconds)))

    def _query(self, query: str, params: dict[str, str]) -> Any:
        """One instant query; failures as _answer's."""
        return self._answer(lambda: self._client.custom_query(query, params=params))

    def _answer(self, ask) -> Any:
        """Prometheus' answer to `ask()`; every failure becomes MetricsUnavailable with a message that names
        Prometheus and what went wrong in our words (exception class, status code and reason), never the answer's
        body."""
        import requests
        from prometheus_api_client import PrometheusApiClientException

        try:
            return ask()
        except requests.exceptions.JSONDecodeError as exc:  # before RequestException: it is one too
            raise MetricsUnavailable(MetricsUnavailable.BAD_RESPONSE,
                                     f"Prometheus at {self.url} sent an answer that is not JSON") from exc
        except requests.exceptions.SSLError as exc:
            raise MetricsUnavailable(MetricsUnavailable.TLS,
                                     f"Prometheus at {self.url}: TLS verification failed (set the CA with "
                                     f"--prometheus-ca-file)") from exc
        except requests.exceptions.Timeout as exc:
            raise MetricsUnavailable(MetricsUnavailable.TIMEOUT, f"Prometheus at {self.url} timed out") from exc
        except requests.exceptions.RequestException as exc:
            raise MetricsUnavailable(MetricsUnavailable.UNREACHABLE,
                                     f"Prometheus at {self.url} is unreachable: {exc}"[:400]) from exc
        except PrometheusApiClientException as exc:
            match = _STATUS_CODE.search(str(exc))
            status = summarize_http_error(int(match.group(1))) if match else "an error"
            reason = (MetricsUnavailable.UNAUTHORIZED if match and match.group(1) in ("401", "403")
                      else MetricsUnavailable.QUERY_FAILED)
            raise MetricsUnavailable(reason, f"Prometheus at {self.url} answered {status}") from exc
        except (ValueError, KeyError, TypeError) as exc:  # JSON without data.result
            raise MetricsUnavailable(MetricsUnavailable.BAD_RESPONSE,
                                     f"Prometheus at {self.url} sent an unreadable answer "
                                     f"({type(exc).__name__})") from exc

"""The Helm chart: lint, values schema, least-privilege RBAC, optional monitoring objects, install/upgrade/uninstall
on the real control plane."""
from __future__ import annotations

import json

import pytest
import yaml

from metronome_testing.chart import chart_release, service_account_kubeconfig
from metronome_testing.checkout import CHART, CRD_NAME, EXAMPLE
from metronome_testing.kube_objects import condition, get_json
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for

MONITORING_APIS = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PrometheusRule")


def _template(cluster, *args: str) -> list[dict]:
    out = cluster.helm("template", "metronome", str(CHART), "--namespace", "metronome-system", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lint_is_clean(cluster):
    result = cluster.helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout, result.stdout


def test_values_schema_rejects_bad_values(cluster):
    for bad in ("logLevel=LOUD", "healthPort=0", "watchNamespaces[0]=Bad_Name", "unknownKey=1", "metricsPort=-1",
                "dashboards.enabled=yes", "dashboards.color=blue"):
        result = cluster.helm("template", "metronome", str(CHART), "--set", bad, check=False)
        assert result.returncode != 0, bad
        assert "schema" in result.stderr.lower() or "values don't meet" in result.stderr, result.stderr


def _rules(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_rbac_is_least_privilege(cluster):
    (role,) = _by_kind(_template(cluster), "ClusterRole")
    rules = _rules(role)
    assert rules[("metronome.dev", "inferenceservices")] == {"list", "watch", "patch"}
    assert rules[("metronome.dev", "inferenceservices/status")] == {"patch"}
    # Every child kind is watched (a deletion or an edit is put right) and written by server-side apply.
    for child in (("apps", "deployments"), ("", "services")):
        assert rules[child] == {"get", "list", "watch", "create", "patch"}, child
    # ConfigMaps: an experiment's candidate config is deleted when it ends.
    for child in (("", "configmaps"), ("policy", "poddisruptionbudgets"), ("monitoring.coreos.com", "podmonitors"),
                  ("monitoring.coreos.com", "prometheusrules")):
        assert rules[child] == {"get", "list", "watch", "create", "patch", "delete"}, child
    # Pods: watched, and relabelled (an experiment's variant label, outside the Deployment's selector: nothing
    # restarts).
    assert rules[("", "pods")] == {"list", "watch", "patch"}
    assert rules[("", "events")] == {"create"}
    assert rules[("apiextensions.k8s.io", "customresourcedefinitions")] == {"get", "list", "watch"}
    # Other autoscalers are only watched: whether one targets a service (the loop then leaves replicas alone).
    assert rules[("autoscaling", "horizontalpodautoscalers")] == rules[("keda.sh", "scaledobjects")] == {"list",
                                                                                                         "watch"}
    every_verb = set().union(*rules.values())
    assert "*" not in every_verb
    # InferencePools: written only where spec.routing asks, and the service's own deleted when it turns off.
    assert rules[("inference.networking.k8s.io", "inferencepools")] == {"get", "list", "watch", "create", "patch",
                                                                         "delete"}
    # Deletes only for children a spec change or --monitor-kind none retires; the rest is garbage-collected.
    assert {resource for (_, resource), verbs in rules.items() if "delete" in verbs} <= {
        "poddisruptionbudgets", "podmonitors", "prometheusrules", "inferencepools", "configmaps"}
    assert not any(resource == "secrets" or "*" in (group, resource) for group, resource in rules)


def test_namespaced_mode_grants_writes_per_namespace_only(cluster):
    docs = _template(cluster, "--set", "watchNamespaces={team-a,team-b}")
    (cluster_role,) = _by_kind(docs, "ClusterRole")
    assert _rules(cluster_role) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
        ("", "namespaces"): {"list", "watch"},  # kopf follows the namespaces it serves
    }
    own = ("-leader-election", "-uninstall")  # the Lease's Role and the uninstall hook's, in the release namespace
    roles = [r for r in _by_kind(docs, "Role") if not r["metadata"]["name"].endswith(own)]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    bindings = [b for b in _by_kind(docs, "RoleBinding") if not b["metadata"]["name"].endswith(own)]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    (deployment,) = _by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


def test_operator_deployment_is_restricted_and_probed(cluster):
    (deployment,) = _by_kind(_template(cluster, "--set", "prometheusUrl=http://prometheus:9090"), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["metronome"] and container["args"][0] == "operator"
    assert "--prometheus-url=http://prometheus:9090" in container["args"] and "--leader-elect" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] and deployment["spec"]["replicas"] == 1


def test_monitoring_objects_only_where_the_api_exists(cluster):
    flags = ["--set", "monitor.kind=ServiceMonitor", "--set", "prometheusRule.enabled=true"]
    without = _template(cluster, *flags)
    assert not _by_kind(without, "ServiceMonitor") and not _by_kind(without, "PrometheusRule")
    api_flags = [arg for api in MONITORING_APIS for arg in ("--api-versions", api)]
    docs = _template(cluster, *flags, *api_flags)
    (monitor,) = _by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "metronome-server"
    (rule,) = _by_kind(docs, "PrometheusRule")
    alerts = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    # Every server's alerts; each service's SLO alerts are the operator's (--slo-alerts), with its own targets.
    assert set(alerts) == {"MetronomeKVBlocksLeaked", "MetronomeConfigReloadErrors"}
    assert "metronome_kv_blocks_leaked" in alerts["MetronomeKVBlocksLeaked"]["expr"]
    assert "metronome_config_reload_errors_total" in alerts["MetronomeConfigReloadErrors"]["expr"]
    assert {"--slo-alerts", "--slo-alert-for=10"} <= set(_args(docs))


def test_rules_carry_the_monitors_labels_as_kube_prometheus_stack_selects_them(cluster):
    api_flags = [arg for api in MONITORING_APIS for arg in ("--api-versions", api)]
    docs = _template(cluster, *api_flags, "--set", "prometheusRule.enabled=true",
                     "--set", "monitor.labels.release=kube-prometheus-stack", "--set", "prometheusRule.labels.team=ml")
    (rule,) = _by_kind(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["labels"]["team"] == "ml"
    # The operator's per-service rules get the same labels.
    assert {"--slo-alert-label=release=kube-prometheus-stack", "--slo-alert-label=team=ml"} <= set(_args(docs))
    assert not [a for a in _args(_template(cluster)) if a.startswith("--slo-alert")]  # off by default


def test_scrape_annotations_only_where_no_monitor_scrapes(cluster):
    api_flags = [arg for api in MONITORING_APIS for arg in ("--api-versions", api)]
    modes = {kind: next(a for a in _args(_template(cluster, *api_flags, "--set", f"monitor.kind={kind}"))
                        if a.startswith("--scrape-annotations="))
             for kind in ("PodMonitor", "ServiceMonitor", "none")}
    assert modes == {"PodMonitor": "--scrape-annotations=auto", "ServiceMonitor": "--scrape-annotations=never",
                     "none": "--scrape-annotations=always"}
    forced = _template(cluster, "--set", "monitor.kind=ServiceMonitor", "--set", "monitor.scrapeAnnotations=always")
    assert "--scrape-annotations=always" in _args(forced)


def _args(docs: list[dict]) -> list[str]:
    (deployment,) = _by_kind(docs, "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_one_monitor_kind_with_the_selector_labels_never_both(cluster):
    api_flags = [arg for api in MONITORING_APIS for arg in ("--api-versions", api)]
    release = ("--set", "monitor.labels.release=kube-prometheus-stack")
    pod = _template(cluster, *api_flags, *release)  # the default kind: PodMonitor, written by the operator
    assert not _by_kind(pod, "ServiceMonitor")
    assert {"--monitor-kind=PodMonitor", "--monitor-label=release=kube-prometheus-stack"} <= set(_args(pod))
    service = _template(cluster, *api_flags, *release, "--set", "monitor.kind=ServiceMonitor")
    (monitor,) = _by_kind(service, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
    assert "--monitor-kind=none" in _args(service) and "--scrape-interval=15" in _args(service)
    assert not any(a.startswith("--monitor-label") for a in _args(service))
    neither = _template(cluster, *api_flags, "--set", "monitor.kind=none", "--set", "monitor.intervalSeconds=30")
    assert not _by_kind(neither, "ServiceMonitor")
    assert "--monitor-kind=none" in _args(neither) and "--scrape-interval=30" in _args(neither)
    bad = cluster.helm("template", "m", str(CHART), "--set", "monitor.kind=Both", check=False)
    assert bad.returncode != 0 and "monitor/kind" in bad.stderr


def test_prometheus_client_values_become_flags_and_mounts(cluster):
    docs = _template(cluster, "--set", "prometheus.allowedUrls={http://team-prom.ml:9090}",
                     "--set", "prometheus.bearerTokenSecret.name=prom-token",
                     "--set", "prometheus.caSecret.name=prom-ca")
    args = _args(docs)
    assert "--allow-prometheus-url=http://team-prom.ml:9090" in args
    assert "--prometheus-bearer-token-file=/etc/metronome/prometheus-token/token" in args
    assert "--prometheus-ca-file=/etc/metronome/prometheus-ca/ca.crt" in args
    assert "--prometheus-insecure-skip-verify" not in args
    (deployment,) = _by_kind(docs, "Deployment")
    secrets = {v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert secrets == {"prom-token", "prom-ca"}


def test_the_operators_metrics_are_served_and_scraped_by_the_chosen_monitor_kind(cluster):
    api_flags = ("--api-versions", "monitoring.coreos.com/v1/PodMonitor")
    docs = _template(cluster, *api_flags, "--set", "monitor.labels.release=kube-prometheus-stack")
    assert "--metrics-port=8081" in _args(docs)
    (deployment,) = _by_kind(docs, "Deployment")
    ports = {p["name"]: p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == 8081
    (monitor,) = [m for m in _by_kind(docs, "PodMonitor") if m["metadata"]["name"].endswith("-operator")]
    assert monitor["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    annotated = _template(cluster, *api_flags, "--set", "monitor.kind=none")
    assert not _by_kind(annotated, "PodMonitor")
    (deployment,) = _by_kind(annotated, "Deployment")
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8081"
    off = _template(cluster, *api_flags, "--set", "metricsPort=0")
    assert not any(a.startswith("--metrics-port") for a in _args(off)) and not _by_kind(off, "PodMonitor")


def test_the_dashboard_configmap_is_off_by_default_and_carries_the_file_unchanged(cluster):
    assert not [d for d in _by_kind(_template(cluster), "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")]
    docs = _template(cluster, "--set", "dashboards.enabled=true", "--set", "dashboards.namespace=monitoring",
                     "--set", "dashboards.annotations.grafana_folder=Metronome")
    (config_map,) = [d for d in _by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")]
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar selects
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Metronome"}
    assert json.loads(config_map["data"]["metronome.json"]) == json.loads(
        (CHART / "dashboards" / "metronome.json").read_text())


def test_server_image_value_becomes_the_flag(cluster):
    assert not [a for a in _args(_template(cluster)) if a.startswith("--server-image")]  # the operator's default
    docs = _template(cluster, "--set", "serverImage=localhost/metronome-server:latest")
    assert "--server-image=localhost/metronome-server:latest" in _args(docs)
    bad = cluster.helm("template", "m", str(CHART), "--set", "serverImage=a b", check=False)
    assert bad.returncode != 0 and "serverImage" in bad.stderr


def test_replicas_elect_a_leader_through_a_lease(cluster):
    docs = _template(cluster, "--set", "replicas=2")
    (deployment,) = _by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert {"--leader-elect", "--lease-namespace=metronome-system", "--lease-duration=15"} <= set(_args(docs))
    (role,) = [r for r in _by_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == "metronome-system"
    assert _rules(role) == {("coordination.k8s.io", "leases"): {"get", "create", "update"}}


def test_helm_install_succeeds_and_the_operator_pod_runs(cluster):
    release = chart_release(cluster)
    assert "kubectl get inferenceservices.metronome.dev" in release.install_output  # NOTES.txt
    status = cluster.helm("status", release.release, "-n", release.namespace, "-o", "json").stdout
    assert json.loads(status)["info"]["status"] == "deployed"
    crd = cluster.kubectl_json("get", "crd", CRD_NAME)
    assert crd["spec"]["names"]["shortNames"] == ["misvc"]

    def operator_ready():
        deployment = cluster.kubectl_json("get", "deployment", "metronome-operator", "-n", release.namespace)
        return deployment["status"].get("readyReplicas") == 1

    wait_for(operator_ready, "the operator Deployment (kwok) to be ready", timeout=120)


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("patch", "inferenceservices.metronome.dev", True),
        ("patch", "inferenceservices.metronome.dev/status", True),
        ("create", "deployments.apps", True),
        ("watch", "services", True),
        ("watch", "pods", True),
        ("patch", "pods", True),
        ("create", "events", True),
        ("delete", "deployments.apps", False),
        ("get", "secrets", False),
        ("create", "pods", False),
    ],
)
def test_service_account_permissions(cluster, verb, resource, allowed):
    release = chart_release(cluster)
    subject = f"system:serviceaccount:{release.namespace}:{release.service_account}"
    resource_name, _, sub = resource.partition("/")
    args = ["auth", "can-i", verb, resource_name, "-n", "default", "--as", subject]
    if sub:
        args += ["--subresource", sub]
    result = cluster.kubectl(*args, check=False)
    assert result.stdout.strip() == ("yes" if allowed else "no"), result.stdout + result.stderr


def test_upgrade_and_uninstall(cluster):
    chart_release(cluster)  # the CRD is in place (a second install skips crds/)
    namespace = cluster.namespace("metronome-b")
    watched = cluster.namespace("team")
    release = "metronome-b"
    cluster.helm("install", release, str(CHART), "-n", namespace, "--set", f"watchNamespaces={{{watched}}}")
    assert cluster.kubectl_json("get", "role", "-n", watched)["items"]
    cluster.helm("upgrade", release, str(CHART), "-n", namespace, "--reuse-values", "--set", "logLevel=DEBUG")
    deployment = cluster.kubectl_json("get", "deployment", "-n", namespace,
                                      "-l", f"app.kubernetes.io/instance={release}")
    (item,) = deployment["items"]
    assert "--log-level=DEBUG" in item["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster.helm("uninstall", release, "-n", namespace, "--wait")
    assert not cluster.kubectl_json("get", "role", "-n", watched)["items"]
    assert not cluster.kubectl_json("get", "deployment", "-n", namespace)["items"]
    cluster.kubectl("get", "crd", CRD_NAME)  # Helm never deletes CRDs


def test_namespaced_install_manages_its_namespaces_with_role_permissions_only(cluster, tmp_path):
    chart_release(cluster)
    namespace, watched, other = cluster.namespace("metronome-c"), cluster.namespace("team"), cluster.namespace("other")
    cluster.helm("install", "metronome-c", str(CHART), "-n", namespace, "--set", f"watchNamespaces={{{watched}}}")
    kubeconfig = service_account_kubeconfig(cluster, namespace, "metronome-c", tmp_path / "kubeconfig")
    operator = OperatorProcess(kubeconfig=kubeconfig, log_dir=tmp_path, scope_args=("--namespace", watched))
    operator.start()
    try:
        for ns in (watched, other):
            cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))

        def ready():
            isvc = get_json(cluster, "inferenceservices.metronome.dev", "smollm2", "-n", watched)
            cond = condition(isvc or {}, "Ready")
            return cond is not None and cond["status"] == "True"

        wait_for(ready, "the watched namespace's service to become Ready", timeout=120)
        # The other namespace is not this operator's business (and its Role would not allow it).
        untouched = get_json(cluster, "inferenceservices.metronome.dev", "smollm2", "-n", other)
        assert "status" not in untouched and get_json(cluster, "deployment", "smollm2", "-n", other) is None
        cluster.kubectl("delete", "inferenceservices.metronome.dev", "smollm2", "-n", watched, "--timeout=60s")
        cluster.kubectl("delete", "inferenceservices.metronome.dev", "smollm2", "-n", other, "--timeout=60s")
    finally:
        operator.stop()
        cluster.helm("uninstall", "metronome-c", "-n", namespace, check=False)
    assert "Forbidden" not in operator.all_logs(), operator.all_logs()[-4000:]

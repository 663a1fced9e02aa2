"""spec.podTemplate: what the operator accepts (and the path it names when it refuses) and how the overlay merges
onto the built pod. The CRD's own checks are exercised on a real API server in tests/integration/test_podtemplate.py.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from metronome.operator import builders
from metronome.operator.pod_template import (
    BUILT_MOUNT_PATHS,
    BUILT_VOLUMES,
    RESERVED_LABELS,
    PodOverlay,
    PodTemplateError,
    merge,
    parse_overlay,
)
from metronome.operator.spec import SpecError, parse_service

ROOT = Path(__file__).resolve().parents[2]
SELECTOR = {"app.kubernetes.io/name": "metronome-server", "metronome.dev/inferenceservice": "chat"}


def built() -> dict:
    """A pod template shaped like the builder's: one server container with env and mounts."""
    return {
        "metadata": {"labels": dict(SELECTOR), "annotations": {"prometheus.io/scrape": "true"}},
        "spec": {
            "containers": [{
                "name": "server",
                "image": "metronome:1",
                "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/.cache/huggingface"}],
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            "automountServiceAccountToken": False,
        },
    }


def overlaid(overlay: dict) -> dict:
    return merge(built(), parse_overlay(overlay), SELECTOR)


def server_of(template: dict) -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"] == "server")


def refused(overlay: dict, path: str) -> str:
    with pytest.raises(PodTemplateError) as error:
        parse_overlay(overlay)
    message = str(error.value)
    assert message.startswith(path), message
    return message


# --- merging -------------------------------------------------------------------------------------------------


def test_no_overlay_leaves_the_pod_as_built():
    assert parse_overlay(None).empty and parse_overlay({}).empty
    assert merge(built(), PodOverlay(), SELECTOR) == built()


def test_labels_are_added_and_annotations_may_replace_ours():
    template = overlaid({"metadata": {"labels": {"team": "ml"},
                                      "annotations": {"prometheus.io/scrape": "false", "owner": "a@b"}}})
    assert template["metadata"]["labels"] == {**SELECTOR, "team": "ml"}
    assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "false", "owner": "a@b"}


def test_pod_fields_are_set():
    fields = {
        "serviceAccountName": "model-reader",
        "automountServiceAccountToken": True,
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "inference-high",
        "runtimeClassName": "nvidia",
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}},
    }
    pod = overlaid({"spec": fields})["spec"]
    for key, value in fields.items():
        assert pod[key] == value, key


def test_server_env_merges_by_name_and_mounts_and_env_from_are_added():
    template = overlaid({"spec": {
        "volumes": [{"name": "token", "secret": {"secretName": "hf"}}],
        "containers": [{
            "name": "server",
            "env": [{"name": "HF_HOME", "value": "/cache/hf"}, {"name": "NEW", "value": "1"}],
            "envFrom": [{"secretRef": {"name": "server-env"}}],
            "volumeMounts": [{"name": "token", "mountPath": "/var/run/hf", "readOnly": True}],
        }],
    }})
    server = server_of(template)
    # The overlay replaces HF_HOME in place, keeps HOME, appends NEW.
    assert server["env"] == [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/cache/hf"},
                             {"name": "NEW", "value": "1"}]
    assert server["envFrom"] == [{"secretRef": {"name": "server-env"}}]
    assert server["volumeMounts"][-1] == {"name": "token", "mountPath": "/var/run/hf", "readOnly": True}
    assert template["spec"]["volumes"][-1] == {"name": "token", "secret": {"secretName": "hf"}}
    assert server["image"] == "metronome:1"


def test_other_containers_are_sidecars_added_as_given():
    sidecar = {"name": "proxy", "image": "envoy:1", "args": ["--config", "/etc/envoy"],
               "ports": [{"containerPort": 9901}], "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}
    containers = overlaid({"spec": {"containers": [sidecar]}})["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server", "proxy"] and containers[1] == sidecar


def test_a_spread_constraint_without_selector_counts_this_services_pods():
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"},
              {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"app": "other"}}}]
    pod = overlaid({"spec": {"topologySpreadConstraints": spread}})["spec"]
    assert pod["topologySpreadConstraints"][0]["labelSelector"] == {"matchLabels": SELECTOR}
    assert pod["topologySpreadConstraints"][1]["labelSelector"] == {"matchLabels": {"app": "other"}}


def test_merging_changes_neither_input():
    template, raw = built(), {"spec": {"containers": [{"name": "server", "env": [{"name": "A", "value": "1"}]}],
                                       "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                                      "whenUnsatisfiable": "DoNotSchedule"}]}}
    template_before, raw_before = copy.deepcopy(template), copy.deepcopy(raw)
    overlay = parse_overlay(raw)
    overlay_before = copy.deepcopy(overlay)
    merge(template, overlay, SELECTOR)
    assert (template, raw, overlay) == (template_before, raw_before, overlay_before)


def test_merge_refuses_what_the_built_pod_already_has():
    """The parse-time checks use BUILT_*; the merge checks the real pod too (a name the builder added later)."""
    template = built()
    template["spec"]["volumes"].append({"name": "cache", "emptyDir": {}})
    with pytest.raises(PodTemplateError, match=r"spec\.podTemplate\.spec\.volumes\[0\]\.name"):
        merge(template, parse_overlay({"spec": {"volumes": [{"name": "cache", "emptyDir": {}}]}}), SELECTOR)
    template["spec"]["containers"][0]["volumeMounts"].append({"name": "cache", "mountPath": "/cache"})
    overlay = parse_overlay({"spec": {"containers": [
        {"name": "server", "volumeMounts": [{"name": "tmp", "mountPath": "/cache/"}]}]}})
    with pytest.raises(PodTemplateError, match=r"containers\[0\]\.volumeMounts\[0\]\.mountPath"):
        merge(template, overlay, SELECTOR)
    template["spec"]["initContainers"] = [{"name": "fetch-model", "image": "m:1"}]
    overlay = parse_overlay({"spec": {"containers": [{"name": "fetch-model", "image": "x:1"}]}})
    with pytest.raises(PodTemplateError, match=r"containers\[0\]\.name"):
        merge(template, overlay, SELECTOR)


# --- refusing, with the path -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overlay", "path"),
    [
        ({"spec": {"hostNetwork": True}}, "spec.podTemplate.spec.hostNetwork"),
        ({"kind": "Pod"}, "spec.podTemplate.kind"),
        ({"spec": {"tolerations": []}}, "spec.podTemplate.spec.tolerations: set spec.resources.tolerations instead"),
        ({"spec": {"nodeSelector": {}}}, "spec.podTemplate.spec.nodeSelector: set spec.resources.nodeSelector"),
        ({"spec": {"terminationGracePeriodSeconds": 5}}, "spec.podTemplate.spec.terminationGracePeriodSeconds: set"),
        ({"metadata": {"name": "x"}}, "spec.podTemplate.metadata.name"),
        ({"spec": {"serviceAccountName": 3}}, "spec.podTemplate.spec.serviceAccountName"),
        ({"spec": {"serviceAccountName": "Bad_Name"}}, "spec.podTemplate.spec.serviceAccountName"),
        ({"spec": {"automountServiceAccountToken": "yes"}}, "spec.podTemplate.spec.automountServiceAccountToken"),
        ({"spec": {"affinity": []}}, "spec.podTemplate.spec.affinity"),
        ({"spec": {"imagePullSecrets": [{"name": "UPPER"}]}}, "spec.podTemplate.spec.imagePullSecrets[0].name"),
        ({"spec": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]}},
         "spec.podTemplate.spec.topologySpreadConstraints[0].whenUnsatisfiable"),
        # volumes
        ({"spec": {"volumes": [{"name": "model", "emptyDir": {}}]}}, "spec.podTemplate.spec.volumes[0].name"),
        ({"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}},
         "spec.podTemplate.spec.volumes[0].hostPath"),
        ({"spec": {"volumes": [{"name": "two", "emptyDir": {}, "secret": {"secretName": "s"}}]}},
         "spec.podTemplate.spec.volumes[0]: set exactly one volume source"),
        ({"spec": {"volumes": [{"name": "none"}]}}, "spec.podTemplate.spec.volumes[0]: set exactly one"),
        ({"spec": {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}},
         "spec.podTemplate.spec.volumes: 'a' appears twice"),
        # the server container
        ({"spec": {"containers": [{"name": "server", "image": "x:1"}]}},
         "spec.podTemplate.spec.containers[0].image: the server container's image comes from spec.image"),
        ({"spec": {"containers": [{"name": "server", "args": ["--x"]}]}},
         "spec.podTemplate.spec.containers[0].args: the server container's args comes from spec.engine.extraArgs"),
        ({"spec": {"containers": [{"name": "server", "resources": {}}]}},
         "spec.podTemplate.spec.containers[0].resources: the server container's resources comes from spec.resources"),
        ({"spec": {"containers": [{"name": "server", "securityContext": {}}]}},
         "spec.podTemplate.spec.containers[0].securityContext"),
        ({"spec": {"containers": [{"name": "server", "volumeMounts": [{"name": "nope", "mountPath": "/x"}]}]}},
         "spec.podTemplate.spec.containers[0].volumeMounts[0].name"),
        ({"spec": {"containers": [{"name": "server", "volumeMounts": [{"name": "tmp", "mountPath": "rel"}]}]}},
         "spec.podTemplate.spec.containers[0].volumeMounts[0].mountPath"),
        ({"spec": {"containers": [{"name": "server", "volumeMounts": [{"name": "tmp", "mountPath": "/models/"}]}]}},
         "spec.podTemplate.spec.containers[0].volumeMounts[0].mountPath"),
        ({"spec": {"containers": [{"name": "server", "env": [{"value": "1"}]}]}},
         "spec.podTemplate.spec.containers[0].env[0].name"),
        ({"spec": {"containers": [{"name": "server", "env": [{"name": "A", "value": "1", "valueFrom": {}}]}]}},
         "spec.podTemplate.spec.containers[0].env[0]: set value or valueFrom"),
        ({"spec": {"containers": [{"name": "server", "env": [{"name": "A"}, {"name": "A"}]}]}},
         "spec.podTemplate.spec.containers[0].env: 'A' appears twice"),
        ({"spec": {"containers": [{"name": "server", "envFrom": [{"prefix": "X_"}]}]}},
         "spec.podTemplate.spec.containers[0].envFrom[0]: set exactly one of configMapRef, secretRef"),
        # sidecars
        ({"spec": {"containers": [{"name": "proxy"}]}}, "spec.podTemplate.spec.containers[0].image"),
        ({"spec": {"containers": [{"name": "Proxy", "image": "e:1"}]}}, "spec.podTemplate.spec.containers[0].name"),
        ({"spec": {"containers": [{"name": "p", "image": "e:1", "securityContext": {"privileged": True}}]}},
         "spec.podTemplate.spec.containers[0].securityContext"),
        ({"spec": {"containers": [{"name": "p", "image": "e:1"}, {"name": "p", "image": "e:2"}]}},
         "spec.podTemplate.spec.containers: 'p' appears twice"),
        # labels and annotations
        ({"metadata": {"labels": {"app.kubernetes.io/instance": "x"}}},
         "spec.podTemplate.metadata.labels.app.kubernetes.io/instance"),
        ({"metadata": {"labels": {"metronome.dev/anything": "x"}}}, "spec.podTemplate.metadata.labels.metronome.dev/"),
        ({"metadata": {"annotations": {"metronome.dev/x": "y"}}}, "spec.podTemplate.metadata.annotations.metronome"),
        ({"metadata": {"labels": {"team": "has space"}}}, "spec.podTemplate.metadata.labels.team"),
        ({"metadata": {"labels": {"bad key!": "x"}}}, "spec.podTemplate.metadata.labels: 'bad key!'"),
        ({"metadata": {"labels": {"team": 3}}}, "spec.podTemplate.metadata.labels.team"),
    ],
)
def test_bad_overlays_are_refused_naming_the_field(overlay, path):
    refused(overlay, path)


def test_a_bad_overlay_is_a_spec_error_of_the_whole_resource():
    body = {"metadata": {"name": "chat", "namespace": "ml"},
            "spec": {"model": {"source": "default"}, "podTemplate": {"spec": {"hostIPC": True}}}}
    with pytest.raises(SpecError, match=r"^spec\.podTemplate\.spec\.hostIPC: not a field the overlay may set"):
        parse_service(body)


# --- one list of names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["default", "random:tiny", "gguf:/data/m.gguf", "hf-dir:/data/m", "pvc:w/x"])
def test_built_names_are_the_ones_the_overlay_may_not_take(source):
    for gpus in (0, 1, 2):
        body = {"metadata": {"name": "chat", "namespace": "ml"},
                "spec": {"model": {"source": source}, "resources": {"gpus": gpus}}}
        pod = builders.deployment(parse_service(body))["spec"]["template"]["spec"]
        assert {v["name"] for v in pod["volumes"]} <= set(BUILT_VOLUMES)
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            for mount in container.get("volumeMounts", []):
                assert any(mount["mountPath"] == p or mount["mountPath"].startswith(p + "/")
                           for p in BUILT_MOUNT_PATHS), mount
        labels = builders.labels("chat")
        assert all(k in RESERVED_LABELS or k.startswith("metronome.dev/") for k in labels)


def test_the_crd_rules_name_the_same_reserved_names():
    text = (ROOT / "crds" / "inferenceservice.yaml").read_text()
    crd = yaml.safe_load(text)
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    pod = spec["podTemplate"]["properties"]["spec"]
    volume_rule = pod["properties"]["volumes"]["items"]["x-kubernetes-validations"][0]["rule"]
    assert volume_rule == "!(self.name in [" + ", ".join(f"'{v}'" for v in BUILT_VOLUMES) + "])"
    mounts = ", ".join(f"'{p}'" for p in BUILT_MOUNT_PATHS)
    container_rules = [r["rule"] for r in pod["properties"]["containers"]["items"]["x-kubernetes-validations"]]
    assert any(f"[{mounts}]" in rule for rule in container_rules)
    label_rule = spec["podTemplate"]["properties"]["metadata"]["properties"]["labels"]["x-kubernetes-validations"]
    assert all(f"'{key}'" in label_rule[0]["rule"] for key in RESERVED_LABELS)
    # The CRD lists exactly the pod fields and volume sources the operator accepts.
    from metronome.operator.pod_template import POD_FIELDS, SIDECAR_FIELDS, VOLUME_SOURCES

    assert set(pod["properties"]) == set(POD_FIELDS)
    assert set(pod["properties"]["volumes"]["items"]["properties"]) == {"name", *VOLUME_SOURCES}
    assert set(pod["properties"]["containers"]["items"]["properties"]) == set(SIDECAR_FIELDS)

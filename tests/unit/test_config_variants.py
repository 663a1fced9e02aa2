"""A server pod serves the candidate config while its labels say so: the projected volume (server.yaml,
candidate.yaml, pod-labels) swapped as the kubelet does, the watcher switching files both ways without a
restart, per-file generations, and the labels file in the kubelet's own format."""
from __future__ import annotations

import pytest

from metronome.contract import variant
from metronome.contract.config import SchedulerConfig
from metronome.server.api.config_watch import ConfigStatus, ConfigWatcher, variant_files
from metronome.server.bench.configfile import project

CONTROL = "generation: 4\nscheduler:\n  chunk_size: 512\n  queue_policy: fcfs\n"
CANDIDATE = "generation: 5\nscheduler:\n  chunk_size: 128\n  queue_policy: fcfs\n"


def volume(folder, *, labels: dict[str, str], control: str = CONTROL, candidate: str | None = CANDIDATE) -> None:
    files = {"server.yaml": control, variant.POD_LABELS_FILE: variant.format_labels(labels)}
    if candidate is not None:
        files[variant.CANDIDATE_CONFIG_FILE] = candidate
    project(folder, files)


def watcher_for(folder):
    base = SchedulerConfig(chunk_size=256, queue_policy="fcfs")
    applied: list[SchedulerConfig] = []
    status = ConfigStatus(config_file=str(folder / "server.yaml"), generation=0, scheduler=base)
    files = variant_files(str(folder / "server.yaml"), str(folder / variant.CANDIDATE_CONFIG_FILE),
                          str(folder / variant.POD_LABELS_FILE))
    return ConfigWatcher(str(folder / "server.yaml"), base, status, apply=applied.append, variants=files), applied


def test_a_pod_turns_candidate_and_back_by_its_label(tmp_path):
    folder = tmp_path / "config"
    volume(folder, labels={"app": "x"})
    watcher, applied = watcher_for(folder)
    assert watcher.load_initial().chunk_size == 512 and watcher.status.variant == variant.CONTROL

    volume(folder, labels={"app": "x", variant.LABEL: variant.CANDIDATE})
    assert watcher.poll_once()
    assert applied[-1].chunk_size == 128
    assert (watcher.status.variant, watcher.status.generation) == (variant.CANDIDATE, 5)
    assert not watcher.poll_once()

    # Back to control: the control file's generation (4) is lower than the candidate's (5) and is served again.
    volume(folder, labels={"app": "x", variant.LABEL: variant.CONTROL})
    assert watcher.poll_once()
    assert applied[-1].chunk_size == 512
    assert (watcher.status.variant, watcher.status.generation, watcher.status.last_reload_error) == (
        variant.CONTROL, 4, None)


def test_a_candidate_label_without_a_candidate_file_serves_the_control(tmp_path):
    folder = tmp_path / "config"
    volume(folder, labels={variant.LABEL: variant.CANDIDATE}, candidate=None)
    watcher, _ = watcher_for(folder)
    assert watcher.load_initial().chunk_size == 512 and watcher.status.variant == variant.CONTROL
    volume(folder, labels={variant.LABEL: variant.CANDIDATE})  # the candidate ConfigMap appears
    assert watcher.poll_once() and watcher.status.variant == variant.CANDIDATE


def test_each_file_only_moves_forward(tmp_path):
    folder = tmp_path / "config"
    volume(folder, labels={variant.LABEL: variant.CANDIDATE})
    watcher, applied = watcher_for(folder)
    watcher.load_initial()
    volume(folder, labels={variant.LABEL: variant.CANDIDATE},
           candidate="generation: 3\nscheduler:\n  chunk_size: 64\n")
    assert not watcher.poll_once()
    assert "older than the applied generation 5" in watcher.status.last_reload_error
    assert applied[-1].chunk_size == 128


def test_an_unreadable_labels_file_reads_as_control(tmp_path):
    folder = tmp_path / "config"
    project(folder, {"server.yaml": CONTROL, variant.CANDIDATE_CONFIG_FILE: CANDIDATE,
                     variant.POD_LABELS_FILE: "garbage without quotes\n\x00"})
    watcher, _ = watcher_for(folder)
    assert watcher.load_initial().chunk_size == 512


def test_labels_file_format_is_the_kubelets():
    # The kubelet writes sorted key="value" lines (Go's %q), no trailing newline.
    text = variant.format_labels({"b": "2", "a": 'say "hi"', variant.LABEL: variant.CANDIDATE})
    assert text == 'a="say \\"hi\\""\nb="2"\nmetronome.dev/variant="candidate"'
    assert variant.parse_labels(text) == {"a": 'say "hi"', "b": "2", variant.LABEL: variant.CANDIDATE}
    assert variant.parse_labels('ok="1"\nbroken\nbad="x\\q"\nempty=""') == {"ok": "1", "empty": ""}
    assert variant.variant_of({variant.LABEL: "control"}) == variant.CONTROL
    assert variant.variant_of({variant.LABEL: "anything"}) == variant.CONTROL


@pytest.mark.parametrize("config, candidate, labels", [(None, "c", "l"), ("s", "c", None), ("s", None, "l")])
def test_the_flags_go_together(config, candidate, labels):
    with pytest.raises(ValueError, match="--candidate-config and --pod-labels go together"):
        variant_files(config, candidate, labels)
    assert variant_files("s", None, None) is None

"""`metronome bench loop --repeats`: every config run several times, round by round, and judged by its means over
the repeats (one run's goodput is too noisy to pick an oracle from). Hand-computed numbers; the glue runs on fake
servers (no process is started)."""
from __future__ import annotations

import argparse
import json

import pytest

from metronome.contract.config import SchedulerConfig
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.loop import cli as loop_cli
from metronome.server.bench.loop import runner as loop
from metronome.server.bench.loop.report import config_stats, oracle, oracle_by_mean, spread, versus


def run(label, goodputs, repeat=1, static=True):
    suffix = "" if repeat == 1 else f" #{repeat}"
    return {"label": label + suffix, "config_label": label, "repeat": repeat, "static": static,
            "goodput_tok_s": (goodputs[0] * 60 + goodputs[1] * 30) / 90,
            "goodput_per_server_s": (goodputs[0] * 60 + goodputs[1] * 30) / 90 / 2,  # on two servers
            "phases": [{"goodput_tok_s": g} for g in goodputs]}


RUNS = [run("static A", [100.0, 20.0]), run("static B", [85.0, 50.0]), run("loop model", [90.0, 45.0], static=False),
        run("static A", [80.0, 40.0], 2), run("static B", [85.0, 50.0], 2), run("loop model", [96.0, 33.0], 2, False)]


def test_each_config_is_summarised_over_its_repeats():
    configs = config_stats(RUNS)
    assert list(configs) == ["static A", "static B", "loop model"]
    a = configs["static A"]
    assert (a["static"], a["repeats"]) == (True, 2)
    assert a["phases"][0] == {"mean": 90.0, "min": 80.0, "max": 100.0, "spread": round(20 / 90, 4)}
    assert a["phases"][1] == {"mean": 30.0, "min": 20.0, "max": 40.0, "spread": round(20 / 30, 4)}
    # Whole runs: (100*60 + 20*30)/90 = 73.33 and (80*60 + 40*30)/90 = 66.67.
    assert a["goodput_tok_s"]["mean"] == pytest.approx(70.0)
    assert (a["goodput_tok_s"]["min"], a["goodput_tok_s"]["max"]) == pytest.approx((200 / 3, 220 / 3))
    assert configs["static B"]["phases"][0]["spread"] == 0.0
    assert a["goodput_per_server_s"]["mean"] == pytest.approx(35.0)


def test_the_oracle_by_means_is_not_the_best_single_run():
    statics = {r["label"]: r["phases"] for r in RUNS if r["static"]}
    single = oracle(statics, durations=[60.0, 30.0])
    assert single["goodput_tok_s"] == pytest.approx((100 * 60 + 50 * 30) / 90)  # A's lucky first run
    by_mean = oracle_by_mean(config_stats(RUNS), durations=[60.0, 30.0])
    assert [b["config"] for b in by_mean["best_by_phase"]] == ["static A", "static B"]
    assert by_mean["goodput_tok_s"] == pytest.approx((90 * 60 + 50 * 30) / 90)
    losses = by_mean["static_losses"]
    assert set(losses) == {"static A", "static B"}  # the loop is no static config
    assert losses["static A"]["loss_by_phase"] == [0.0, 0.4]  # 30 against B's 50
    assert losses["static B"]["loss_by_phase"] == [round(1 - 85 / 90, 4), 0.0]
    assert versus(config_stats(RUNS)["loop model"]["goodput_tok_s"]["mean"], by_mean) == round(
        ((90 * 60 + 45 * 30) / 90 + (96 * 60 + 33 * 30) / 90) / 2 / ((90 * 60 + 50 * 30) / 90), 4)
    assert versus(70.0, {}) is None and versus(70.0, {"goodput_tok_s": 0.0}) is None


def test_with_one_repeat_the_oracle_by_means_is_the_oracle():
    once = [r for r in RUNS if r["repeat"] == 1]
    statics = {r["label"]: r["phases"] for r in once if r["static"]}
    assert oracle_by_mean(config_stats(once), [60.0, 30.0]) == oracle(statics, [60.0, 30.0])
    assert spread(config_stats(once))["by_config"] == {"static A": [0.0, 0.0], "static B": [0.0, 0.0],
                                                       "loop model": [0.0, 0.0]}


def test_the_largest_spread_per_phase_names_its_config():
    result = spread(config_stats(RUNS))
    assert result["by_config"]["loop model"] == [round(6 / 93, 4), round(12 / 39, 4)]
    assert result["largest_by_phase"] == [{"phase": 0, "config": "static A", "spread": round(20 / 90, 4)},
                                          {"phase": 1, "config": "static A", "spread": round(20 / 30, 4)}]
    assert spread({}) == {"by_config": {}, "largest_by_phase": []}


def test_repeats_run_round_by_round_with_suffixed_labels():
    plans = [loop.RunPlan("loop model", None, SchedulerConfig()), loop.RunPlan("static 512/split", None,
                                                                                SchedulerConfig())]
    assert [(p.label, p.config_label, p.repeat) for p in loop.repeated(plans, 3)] == [
        ("loop model", "loop model", 1), ("static 512/split", "static 512/split", 1),
        ("loop model #2", "loop model", 2), ("static 512/split #2", "static 512/split", 2),
        ("loop model #3", "loop model", 3), ("static 512/split #3", "static 512/split", 3)]
    assert loop.repeated(plans, 1) == plans


# Tokens per phase (2 s each) of each run on the fake servers: goodput = tokens / 2, every request good.
TOKENS = {("loop model", 1): (8, 8), ("static 512/split", 1): (10, 2), ("static 256/fcfs", 1): (4, 8),
          ("loop model", 2): (12, 8), ("static 512/split", 2): (6, 6), ("static 256/fcfs", 2): (4, 4)}


def test_the_command_repeats_every_run_and_reports_by_means(tmp_path, monkeypatch, capsys):
    started, written = [], []

    async def fake_ready(fleet, plan, config, settings, pool, progress, load=None):
        started.append(fleet.work_dir.name)

    async def fake_run_on(plan, fleet, config, settings, load, progress):  # on two servers
        records = [RequestRecord(index=phase, kind="short", max_tokens=n, sent_s=2.0 * phase, output_tokens=n,
                                 token_times_s=[2.0 * phase + 0.1 + 0.01 * i for i in range(n)],
                                 end_s=2.0 * phase + 0.1 + 0.01 * n)
                   for phase, n in enumerate(TOKENS[plan.config_label, plan.repeat])]
        return {"label": plan.label, "config_label": plan.config_label, "repeat": plan.repeat,
                "static": plan.autotune is None, "tuning_policy": None, "initial": {}, "last_generation": 1,
                "server_seconds": 8.0, "server_seconds_by_phase": [4.0, 4.0], "intervals": [], "records": records}

    report = loop.report
    monkeypatch.setattr(loop, "report", lambda runs, *rest: written.append(len(runs)) or report(runs, *rest))
    monkeypatch.setattr(loop, "_ready", fake_ready)
    monkeypatch.setattr(loop, "_run_on", fake_run_on)
    parser = argparse.ArgumentParser()
    loop_cli.configure(parser)
    out = tmp_path / "loop.json"
    args = parser.parse_args(["--phases", "long-short:1:2,long-short:1:2", "--slo-tbt-ms", "1000",
                              "--tuning-policies", "model", "--static", "512,split", "--static", "256,fcfs",
                              "--repeats", "2", "--work-dir", str(tmp_path), "--out", str(out)])
    assert loop_cli.main(args) == 0
    assert written == [1, 2, 3, 4, 5, 6, 6]  # the JSON after every run, then once more
    assert len(set(started)) == 6  # fresh servers in a folder of its own for each run
    result = json.loads(out.read_text())
    assert [(r["label"], r["config_label"], r["repeat"]) for r in result["runs"]] == [
        ("loop model", "loop model", 1), ("static 512/split", "static 512/split", 1),
        ("static 256/fcfs", "static 256/fcfs", 1), ("loop model #2", "loop model", 2),
        ("static 512/split #2", "static 512/split", 2), ("static 256/fcfs #2", "static 256/fcfs", 2)]
    # Goodputs per phase: 512/split 5 and 3, then 1 and 3; 256/fcfs 2 and 2, then 4 and 2.
    assert result["oracle"]["goodput_tok_s"] == pytest.approx((5 + 4) / 2)  # the best single runs
    assert [b["config"] for b in result["oracle"]["best_by_phase"]] == ["static 512/split", "static 256/fcfs"]
    by_mean = result["oracle_by_mean"]
    assert [b["goodput_tok_s"] for b in by_mean["best_by_phase"]] == [4.0, 3.0]
    assert by_mean["static_losses"]["static 512/split"]["loss_by_phase"] == [0.0, round(1 - 2 / 3, 4)]
    model = result["configs"]["loop model"]
    assert (model["goodput_tok_s"]["mean"], model["goodput_vs_oracle"]) == (4.5, round(4.5 / 3.5, 4))
    assert result["runs"][0]["targets"]["goodput_vs_oracle"] == round(4.0 / 3.5, 4)
    assert result["spread"]["largest_by_phase"] == [{"phase": 0, "config": "static 512/split", "spread": 0.5},
                                                    {"phase": 1, "config": "static 512/split", "spread": 1.0}]
    summary = capsys.readouterr().out
    assert "loop model               goodput 4.5 (4.0-5.0) tok/s over 2 run(s) (per phase: 5.0 (4.0-6.0), " \
           "4.0 (4.0-4.0)), 2.2 (2.0-2.5) tok per server-second; vs oracle by means 1.2857" in summary
    assert ("oracle by means (best static mean per phase: static 512/split, static 256/fcfs of 2 static configs): "
            "3.50 tok/s") in summary

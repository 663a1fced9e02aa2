"""The tuner: the control logic of the operator, pure (no kopf, no Kubernetes or Prometheus calls).

- `settings.py`: `AutotuneSpec`, what the tuner is asked to do, and the controller's constants;
- `observation.py`: `Observation`, what the metrics said over one window, or `MetricsUnavailable`;
- `step_model.py`: the step-time fit and what it predicts;
- `decision.py`: `CurrentConfig` (what is served, as a prefill budget) and `Decision`;
- `controller.py`: `decide`, the rules in order;
- `replicas.py`: the replica half: the offered load, the step model's replica count, the scale-down's
  stabilization window;
- `actuation.py`: `tune`, one step for one service (decide, lay the budget out, the next server.yaml), which the
  operator and `metronome bench loop` both call;
- `autotune.py`: `step`, a reading → status fields, lastDecision, Events and what to write (`TuneResult`), and
  `TunerMemory` between readings.

The glue around it lives one level up: operator/metrics_source.py turns Prometheus into Observations,
operator/control_loop.py reads and writes through the API.
"""

"""Live A/B experiments of server configs on a slice of a service's replicas (`spec.experiment`, or the autotuner's
riskier moves with `spec.autotune.canary`). Pure, except `source.py` (Prometheus range queries):

- `settings.py`: spec.experiment as plain data, and the candidate config it names;
- `children.py`: which pods run the candidate, their label patches and the candidate's ConfigMap;
- `stats.py`: the sign test's distribution-free bounds and the exact test on error counts;
- `queries.py`: the per-window PromQL of each group (a pod-name matcher on the same queries), results → windows;
- `verdict.py`: windows → promote, revert, no difference, or keep measuring, with the measured ratios;
- `lifecycle.py`: one step of an experiment's life, from the CR's status and what was observed to the next
  status and the actions to carry out;
- `canary.py`: which of the autotuner's moves go through an experiment.
"""

"""`metronome bench loop` (cli.py): the operator's control loop against real servers, minus Kubernetes and
Prometheus (runner.py) — a phased workload (phases.py) sent on time (load.py) to `metronome serve` processes
(servers.py), their /metrics answering the operator's queries (scrape.py) — reported against static configs
(report.py) and drawn as a timeline (plot.py)."""

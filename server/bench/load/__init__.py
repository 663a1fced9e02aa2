"""The load core of every benchmark: what each request asks for and when (workloads.py), the clients that send it
and stamp every token (clients.py, records.py), the open- and closed-loop runner (runner.py), latency statistics
(stats.py), the results file, tables and figures (results.py, report.py, plots.py, run_output.py); and the commands
built directly on it, `bench run` and `bench sweep` (commands.py, sweep.py)."""

"""Benchmarks of a real `metronome serve` (local_server.py) under hostile or heavy use: `bench isolation`
(isolation.py, with the server's own view in isolation_server.py), `bench fuzz` (fuzz_soak.py), both with flags in
cli.py, and `bench stream-cost`, the CPU one streamed token costs (stream_cost.py)."""

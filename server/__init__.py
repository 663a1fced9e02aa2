"""The Metronome model server: engine, models, HTTP API, metrics, config and bench.

Kept import-light: `metronome.server.config` and `metronome.server.metric_names` are shared with the operator,
whose image has no torch.
"""

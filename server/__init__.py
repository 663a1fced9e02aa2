"""The Metronome model server: engine, models, HTTP API, metrics and bench.

Its contract with the operator (config schema, metric names, errors) lives in `metronome.contract`.
"""

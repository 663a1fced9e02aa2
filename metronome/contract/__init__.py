"""The light contract both halves import: the server config schema and its prefill budget, metric names, error
types and the model-source syntax. Pydantic and yaml only — the operator's image has no torch, and
`metronome operator` must start fast.
"""

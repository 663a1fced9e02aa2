"""`metronome bench engine` (command.py): the in-process engine's decode, prefill, long-short and saturation
measurements (sections.py, saturation.py) against the device's measured peaks (device_peaks.py) and the model's
byte and FLOP floors (model_math.py), and the same requests through transformers (hf_peer.py)."""

"""The `metronome serve` flags the operator sets on every server pod, named once.

operator/builders.py writes them from spec fields, operator/spec.py refuses them in spec.engine.extraArgs (the
CRD's CEL rule lists the same), and the server's own parser defines them (server/api/serve_cli.py,
server/engine/flags.py); tests/unit/test_builders_podspec.py holds the four together, parsing the operator's
command line with the server's parser. The list lives in the contract because the operator never imports the
server.
"""
from __future__ import annotations

MODEL = "--model"
SERVED_MODEL_NAME = "--served-model-name"
CONFIG = "--config"
HOST = "--host"
PORT = "--port"
DEVICE = "--device"
DTYPE = "--dtype"
MAX_MODEL_LEN = "--max-model-len"
BLOCK_SIZE = "--block-size"
ATTENTION_BACKEND = "--attention-backend"
MAX_WAITING = "--max-waiting"
TENSOR_PARALLEL_SIZE = "--tensor-parallel-size"
DRAIN_SECONDS = "--drain-seconds"
MAX_REQUEST_BODY_BYTES = "--max-request-body-bytes"
MAX_WAITING_PER_CLIENT = "--max-waiting-per-client"
MAX_RUNNING_PER_CLIENT = "--max-running-per-client"
MAX_PROMPT_TOKENS_PER_SECOND_PER_CLIENT = "--max-prompt-tokens-per-second-per-client"
PROMPT_TOKEN_BURST_PER_CLIENT = "--prompt-token-burst-per-client"
QUANTIZATION = "--quantization"
KV_CACHE_DTYPE = "--kv-cache-dtype"

# In the order of the CRD's CEL rule.
OPERATOR_OWNED = (
    MODEL, SERVED_MODEL_NAME, CONFIG, HOST, PORT, DEVICE, DTYPE, MAX_MODEL_LEN, BLOCK_SIZE, ATTENTION_BACKEND,
    MAX_WAITING, TENSOR_PARALLEL_SIZE, DRAIN_SECONDS, MAX_REQUEST_BODY_BYTES, MAX_WAITING_PER_CLIENT,
    MAX_RUNNING_PER_CLIENT, MAX_PROMPT_TOKENS_PER_SECOND_PER_CLIENT, PROMPT_TOKEN_BURST_PER_CLIENT, QUANTIZATION,
    KV_CACHE_DTYPE,
)

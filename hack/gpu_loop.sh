#!/usr/bin/env bash
# `metronome bench loop` on the GPU machine, in one device call: installs the wheels the image lacks
# (.gpuwheels/: pydantic, fastapi, starlette, uvicorn, opentelemetry-api and their needs, carried along), runs the
# loop benchmark with the arguments given, and brings back its JSON (rewritten after every run, so a run cut short
# by LIMIT keeps the runs before it), its PNG, the log and a tarball of the servers' logs. From the repository root:
#
#     LIMIT=540 bash hack/gpu_loop.sh --phases ... --static 512,split ...   # writes $OUT/loop.json, $OUT/loop.png
#
# The device is fixed here (CUDA, bf16, prefix caching off, one reused server); the model is MODEL (default
# random:llama-3-8b; e.g. MODEL=random:qwen3-30b-a3b for a mixture of experts); everything else is passed through.
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
LIMIT=${LIMIT:-540}
MODEL=${MODEL:-random:llama-3-8b}
WORK=$(mktemp -d /tmp/gpu_loop.XXXX)
mkdir -p "$OUT"
WH=/tmp/metronome-wheels  # imports from the root as `python3 -m` (see hack/gpu_run.sh for why not PYTHONPATH=root)
mkdir -p "$WH"
if ls .gpuwheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install --no-deps --no-index -q --target "$WH" .gpuwheels/*.whl > "$OUT/loop.log" 2>&1
fi
export PYTHONPATH=$WH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/loop.log" 2>&1
# fail in seconds, not after a server start: what `metronome serve` imports (fastapi, uvicorn: carried wheels)
python3 -c "import uvicorn, metronome.server.api.app, metronome.server.api.serve_cli" >> "$OUT/loop.log" 2>&1 || {
  echo "imports failed: see loop.log" >> "$OUT/loop.log"; exit 3; }
PLOT=()
if python3 -c "import matplotlib" 2>/dev/null; then PLOT=(--plot "$OUT/loop.png"); fi
timeout -k 10 "$LIMIT" python3 -m metronome.cli bench loop --model "$MODEL" --device cuda \
  --reuse-servers --serve-arg=--no-prefix-caching --work-dir "$WORK" --out "$OUT/loop.json" "${PLOT[@]}" "$@" \
  >> "$OUT/loop.log" 2>&1
rc=$?
echo "bench loop rc=$rc" >> "$OUT/loop.log"
tar -czf "$OUT/loop-servers.tgz" -C "$WORK" . 2>/dev/null
exit $rc

#!/usr/bin/env bash
# The one GPU call: GPU tests, then `metronome bench engine` on random:llama-3-8b (bf16) in pieces, then decode
# with --enforce-eager, all written to $OUT. Run from the repository root on the GPU machine with the git-ignored
# .gpuwheels/ carried along (pydantic for the image, and pytest/rich in .gpuwheels/extra/ if the image lacks them):
#
#     bash hack/gpu_run.sh            # ~5-6 minutes; every piece has its own time limit, all within ~580 s
#
# Pieces (each one's partial output still comes back if a later one fails or overruns):
#   $OUT/gpu-tests.log                      tests/gpu (-x -q, TEST_LIMIT s)
#   $OUT/h200-engine-a.json, bench-a.log    device, decode (batch 1/16/64/256 at 2k context), prefill
#   $OUT/h200-engine-b.json, bench-b.log    long-short per chunk size and rate
#   $OUT/h200-tbt-vs-throughput.png         TBT p99 vs throughput per chunk size (if matplotlib imports there)
#   $OUT/h200-decode-eager.json, bench-eager.log   decode with CUDA graphs off
#   $OUT/h200-engine-c.json, bench-c.log    the 200-request batch: our engine vs transformers (time left permitting)
#   $OUT/h200-engine.json, bench.log        a + b + c merged, targets evaluated, decode graphs vs eager side by side
# Knobs (environment): TEST_LIMIT, RATES, DURATION, CHUNKS, HF_REQUESTS, HF_TIMEOUT, SKIP_TESTS=1, SKIP_HF=1, and
# SMOKE=1 (tiny model on the CPU: checks the script's plumbing in a copy of the repo, not the GPU).
# (no `set -u`: empty option arrays would trip it on older bash)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
TEST_LIMIT=${TEST_LIMIT:-45}
RATES=${RATES:-10,30}
DURATION=${DURATION:-3}
CHUNKS=${CHUNKS:-256,512,1024,2048,unchunked}
HF_REQUESTS=${HF_REQUESTS:-200}
HF_TIMEOUT=${HF_TIMEOUT:-60}
START=$SECONDS
stamp() { echo "[gpu_run +$((SECONDS - START))s] $*" | tee -a "$OUT/gpu_run.log"; }

# --- imports. Python runs with -P (no cwd / script folder on sys.path): from the repo root, its `operator/` folder
# would shadow the standard library's `operator` and its bare `metronome/` folder the package. The package is put
# together in /tmp instead: metronome/*.py plus the three code folders as sub-packages; wheels the image lacks go
# to /tmp/metronome-wheels.
PKG=/tmp/metronome-pkg
WH=/tmp/metronome-wheels
mkdir -p "$PKG/metronome" "$WH"
cp metronome/*.py "$PKG/metronome/"
for folder in server kernels operator; do ln -sfn "$ROOT/$folder" "$PKG/metronome/$folder"; done
python3 -P -m pip install --no-deps --no-index -q --target "$WH" .gpuwheels/*.whl >> "$OUT/gpu_run.log" 2>&1
for mod in pytest rich; do
  if ! python3 -P -c "import $mod" 2>/dev/null && ls .gpuwheels/extra/*.whl >/dev/null 2>&1; then
    python3 -P -m pip install --no-deps --no-index -q --target "$WH" .gpuwheels/extra/*.whl >> "$OUT/gpu_run.log" 2>&1
    break
  fi
done
export PYTHONPATH=$PKG:$WH
python3 -P - <<'EOF' 2>&1 | tee -a "$OUT/gpu_run.log"
import importlib, sys
for mod in ("torch", "triton", "transformers", "pydantic", "rich", "pytest", "matplotlib", "metronome.server.engine.engine"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod}: {getattr(m, '__version__', 'ok')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{mod}: MISSING ({exc})")
import torch
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA", "python", sys.version.split()[0])
EOF
PLOT=()
if python3 -P -c "import matplotlib" 2>/dev/null; then PLOT=(--plot "$OUT/h200-tbt-vs-throughput.png"); fi
BENCH=(python3 -P -m metronome.cli bench engine --model random:llama-3-8b --device cuda --no-progress)
SMOKE_ARGS=()  # SMOKE=1: the same pieces on the CPU with a tiny model (checks this script, not the GPU)
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_ARGS=(--device cpu --model random:tiny --copy-mb 4 --matmul-size 64 --reps 2 --batch-sizes 1,3 --context 48
              --decode-steps 3 --prefill-prompt-len 40 --prefill-prompts 2 --prefill-chunk 128 --rates 30
              --chunk-sizes 16,unchunked --duration 1 --long-prompt-len 100 --short-prompt-len 10 --output-len 5
              --hf-requests 3 --batch-chunk-size 32 --warmup-requests 1 --skip-hf)
fi
left() { echo $((575 - (SECONDS - START))); }  # the run tool stops a command at 600 s

# --- (a) GPU tests (alphabetical: the CUDA-graph tests run first)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stamp "GPU tests (limit ${TEST_LIMIT}s)"
  timeout -k 5 "$TEST_LIMIT" python3 -P -m pytest tests/gpu -x -q -s -p no:cacheprovider -o addopts="" \
    > "$OUT/gpu-tests.log" 2>&1
  rc=$?
  stamp "GPU tests rc=$rc: $(tail -n 1 "$OUT/gpu-tests.log")"
fi

# --- (b1) device peaks, decode vs the HBM floor (CUDA graphs on), prefill
stamp "bench part a: device,decode,prefill"
timeout -k 10 150 "${BENCH[@]}" --sections device,decode,prefill --batch-sizes 1,16,64,256 --decode-steps 20 \
  "${SMOKE_ARGS[@]}" --out "$OUT/h200-engine-a.json" > "$OUT/bench-a.log" 2>&1
rc=$?; stamp "bench part a rc=$rc"

# --- (b2) long-short per chunk size at rates around saturation (runs of DURATION seconds of arrivals)
stamp "bench part b: longshort (rates $RATES, ${DURATION}s each, chunks $CHUNKS)"
timeout -k 10 150 "${BENCH[@]}" --sections longshort --rates "$RATES" --duration "$DURATION" \
  --chunk-sizes "$CHUNKS" --warmup-requests 8 --drain-timeout 25 --no-records "${PLOT[@]}" \
  "${SMOKE_ARGS[@]}" --out "$OUT/h200-engine-b.json" > "$OUT/bench-b.log" 2>&1
rc=$?; stamp "bench part b rc=$rc"

# --- (c) decode with CUDA graphs off, for the on/off comparison
stamp "bench eager decode"
timeout -k 10 60 "${BENCH[@]}" --sections decode --batch-sizes 1,64 --decode-steps 10 --enforce-eager \
  "${SMOKE_ARGS[@]}" --out "$OUT/h200-decode-eager.json" > "$OUT/bench-eager.log" 2>&1
rc=$?; stamp "bench eager decode rc=$rc"

# --- (b3) the same request batch through our engine and transformers' continuous batching, with what time is left
if [ "${SKIP_HF:-0}" != 1 ] && [ "$(left)" -gt 60 ]; then
  stamp "bench part c: hf ($HF_REQUESTS requests, transformers limit ${HF_TIMEOUT}s, $(left)s left)"
  timeout -k 5 "$(left)" "${BENCH[@]}" --sections hf --hf-requests "$HF_REQUESTS" --hf-timeout "$HF_TIMEOUT" \
    "${SMOKE_ARGS[@]}" --out "$OUT/h200-engine-c.json" > "$OUT/bench-c.log" 2>&1
  rc=$?; stamp "bench part c rc=$rc"
fi

python3 -P hack/merge_engine_json.py "$OUT/h200-engine.json" "$OUT/h200-engine-a.json" "$OUT/h200-engine-b.json" \
  "$OUT/h200-engine-c.json" --eager "$OUT/h200-decode-eager.json" 2>&1 | tee -a "$OUT/gpu_run.log"
cat "$OUT"/bench-a.log "$OUT"/bench-b.log "$OUT"/bench-eager.log "$OUT"/bench-c.log 2>/dev/null \
  | grep -v "━\|┃" > "$OUT/bench.log"
stamp "done"
grep -h -i "warning\|error\|Traceback" "$OUT"/bench-*.log | head -20

#!/usr/bin/env bash
# `metronome bench isolation` on the GPU machine, in one device call. Its 16 cores let the server run
# on cores of its own (taskset) while the steady streams and the hostile injector run on the others: on the
# 2-vCPU development VM the injector takes the server's CPU, so "hostile requests slow the others" there mixes
# what the server does with what the machine lacks. From the repository root, with .gpuwheels/ carried along:
#
#     bash hack/gpu_isolation.sh            # random:tiny on 2 pinned cores, then random:llama-3-8b on the GPU
#     SMOKE=1 bash hack/gpu_isolation.sh    # random:tiny only, short phases (checks this script on any machine)
#     GPU_ONLY=1 bash hack/gpu_isolation.sh # random:llama-3-8b on the GPU alone (a shorter device call)
#     RATE=200 GPU_ONLY=1 BENCH_ARGS="--stream-tokens 512" bash hack/gpu_isolation.sh
#                                           # then the 8B again with --max-prompt-tokens-per-second-per-client 200
#     API_SERVERS=3 GPU_ONLY=1 bash hack/gpu_isolation.sh
#                                           # then the 8B again with --api-servers 3 (on the same 4 server cores)
#     NO_WARMUP=1 ...                       # no unreported bench run first: the measured run has the server's
#                                           # first burst (which stalled one step before serve's start-up burst)
#
# Every server logs its full (generation-2) garbage collections and their pauses (a sitecustomize on its path);
# the random:tiny server runs twice, the first time with `serve`'s start-up gc.freeze() made a no-op, so the
# pauses the freeze removes are measured in the same call. Leaves $OUT/isolation-<name>.json (raw results),
# isolation-<name>.log (the server's, with its GC lines) and isolation.log.
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
LOG=$OUT/isolation.log
PHASE_SECONDS=${PHASE_SECONDS:-10}
ROUNDS=${ROUNDS:-4}
SERVER_CPUS=${SERVER_CPUS:-0-3}
BENCH_CPUS=${BENCH_CPUS:-4-15}
WH=/tmp/metronome-wheels  # as in hack/gpu_run.sh: carried wheels, imported next to the checkout
mkdir -p "$WH"
if ls .gpuwheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install --no-deps --no-index -q --target "$WH" .gpuwheels/*.whl >> "$LOG" 2>&1
fi
export PYTHONPATH=$WH
if [ "${SMOKE:-0}" = 1 ]; then
  PHASE_SECONDS=2 ROUNDS=1 SERVER_CPUS=0 BENCH_CPUS=1
fi
nproc >> "$LOG"
TRACE=$(mktemp -d /tmp/gc_trace.XXXX)
cat > "$TRACE/sitecustomize.py" <<'EOF'
import gc, os, sys, time
_start = [0.0]
def _trace(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    elif info["generation"] == 2:
        sys.stderr.write(f"GC2 pause {(time.perf_counter() - _start[0]) * 1e3:.1f} ms at {time.time():.3f}\n")
gc.callbacks.append(_trace)
if os.environ.get("GC_NO_FREEZE"):
    gc.freeze = lambda: None  # the server as it was before its start-up freeze
EOF

wait_ready() {  # $1 port, $2 seconds
  python3 - "$1" "$2" <<'EOF'
import sys, time, urllib.request
port, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(1)
EOF
}

one() {  # $1 name, $2 model, $3 device, $4 server cores, $5 ready timeout (s), $6 more serve words; GC_NO_FREEZE=1 in the environment
  local name=$1 port=18016 ready_at
  echo "[$(date -u +%T)] $name: serve $2 on $3, cores $4; bench on cores $BENCH_CPUS" | tee -a "$LOG"
  PYTHONPATH=$TRACE:$WH OMP_NUM_THREADS=1 taskset -c "$4" python3 -m metronome.cli serve --model "$2" --device "$3" --host 127.0.0.1 \
    --port $port --max-waiting 16 --log-level warning ${6:-} > "$OUT/isolation-$name.log" 2>&1 &
  local server=$!
  if wait_ready $port "$5"; then
    ready_at=$(date +%s.%N)
    local bench=(taskset -c "$BENCH_CPUS" python3 -m metronome.cli bench isolation --url "http://127.0.0.1:$port"
                 --model "$2" ${BENCH_ARGS:-})
    if [ "${NO_WARMUP:-0}" != 1 ]; then  # NO_WARMUP=1: the measured run meets the server's first burst itself
      "${bench[@]}" --phase-seconds 3 --rounds 4 --out /tmp/isolation-warmup.json >> "$LOG" 2>&1  # not reported; every kind once
    fi
    "${bench[@]}" --phase-seconds "$PHASE_SECONDS" --rounds "$ROUNDS" --out "$OUT/isolation-$name.json" \
      >> "$LOG" 2>&1
    echo "[$(date -u +%T)] $name: bench rc=$?" | tee -a "$LOG"
  else
    echo "$name: server not ready in $5 s" | tee -a "$LOG"
  fi
  kill "$server"; wait "$server" 2>/dev/null
  echo "$name: full collections after ready, pause ms: $(awk -v t="$ready_at" \
    '$1 == "GC2" && $6 > t {print $3}' "$OUT/isolation-$name.log" | sort -n | tr '\n' ' ')" | tee -a "$LOG"
}

TINY_CPUS="${SERVER_CPUS%%-*}-$(( ${SERVER_CPUS%%-*} + 1 ))"
if [ "${GPU_ONLY:-0}" != 1 ]; then
  GC_NO_FREEZE=1 one tiny-cpu-no-freeze random:tiny cpu "$TINY_CPUS" 120
  one tiny-cpu random:tiny cpu "$TINY_CPUS" 120
fi
if [ "${SMOKE:-0}" != 1 ]; then
  one llama-3-8b-h200 random:llama-3-8b cuda "$SERVER_CPUS" 240
  if [ -n "${RATE:-}" ]; then
    one llama-3-8b-h200-rate random:llama-3-8b cuda "$SERVER_CPUS" 240 "--max-prompt-tokens-per-second-per-client $RATE"
  fi
  if [ -n "${API_SERVERS:-}" ]; then
    one llama-3-8b-h200-api$API_SERVERS random:llama-3-8b cuda "$SERVER_CPUS" 240 "--api-servers $API_SERVERS"
  fi
fi
tail -n 40 "$LOG"

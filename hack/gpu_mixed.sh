#!/usr/bin/env bash
# The mixed-step overlap and FlashAttention-4 on the H200, in one device call of at most BUDGET seconds (470 by
# default: wheels, FA4's compiles and four parts), in priority order, each part with its own limit and the later
# parts' minimum time kept back, so that what runs out of time is the least important:
#
#   tests      tests/gpu/test_mixed_gpu.py (two streams = one stream bit for bit, overlapped = whole step's greedy
#              tokens, graph replay = eager) and tests/gpu/test_flash_attn4_gpu.py (FA4 = the torch reference on
#              paged, GQA, chunked inputs with windows, softcap, sinks; an engine on FA4)       -> gpu-tests.log
#   mixed      hack/profile_mixed.py --profile: 64 decodes at 2k + a chunk of 128, 512, 2048, the step whole vs
#              overlapped vs split, interleaved, async scheduling on, against its floor, with the overlap of
#              kernel time over GPU-busy time                                                  -> mixed.json
#   longshort  bench engine long-short at 45 and 60 req/s x chunk 512 and 1024, overlap off and on back to back,
#              DURATION (10) s of arrivals each                                                -> longshort.json
#   fa4ab      hack/bench_attention.py: FA4 vs Triton per batch class, as the `auto` table   -> attention_table.json
#   saturation bench engine saturation (SAT_MAX requests of 1,000 + 1,000 tokens at once, FP8 weights and KV by
#              default: SAT_ARGS) once per SAT_MODES mode (off pipeline), each its own engine -> saturation-<mode>.json
#   always     gpu_mixed.log (this script's stamps and each part's summary), bench.log (the parts' output)
#
# Wheels: .gpuwheels/ (carried: pydantic and the rest of what the image lacks); FA4 and its needs from
# .fa4wheels/call2 (carried) joined with the libs-cu13 wheel's first part, which a
# previous call on the same warm machine left in /tmp/fa4 (hack/fa4_wheels.sh says how); without them the FA4
# parts report FA4 absent and the rest runs. Knobs: PARTS ("tests mixed longshort fa4ab"), BUDGET, TEST_LIMIT,
# TEST_FILES and TESTS_K (a pytest -k), DURATION, RATES, CHUNKS, MODE, LONGSHORT_ORDER ("off,MODE" by default;
# "MODE,off" runs the overlap first, to tell a run's order from its mode) and LONGSHORT_LIMIT (the long-short's),
# VARIANTS,
# MIXED_CHUNKS and MIXED_LIMIT (the profile's), SAT_MODES, SAT_MAX, SAT_ARGS, SMOKE=1 (the CPU with a tiny model:
# this script's plumbing, not the GPU).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PARTS=${PARTS:-tests mixed longshort fa4ab}
BUDGET=${BUDGET:-470}
DURATION=${DURATION:-10}
RATES=${RATES:-45,60}
CHUNKS=${CHUNKS:-512,1024}
TEST_LIMIT=${TEST_LIMIT:-100}  # the tests' cap; the engines of tiny models compile and capture for most of it
MODE=${MODE:-on}
LONGSHORT_ORDER=${LONGSHORT_ORDER:-off,$MODE}
VARIANTS=${VARIANTS:-whole,overlap,split}
MIXED_CHUNKS=${MIXED_CHUNKS:-128,512,2048}
MIXED_LIMIT=${MIXED_LIMIT:-120}
# long-short: ~80 s to build and capture the engine, then per (rate, chunk, mode) run its arrivals plus ~12 s of
# warm-up and drain (its JSON is written at the end: a run cut short leaves nothing)
LONGSHORT_RUNS=$(( $(tr ',' '\n' <<< "$RATES" | wc -l) * $(tr ',' '\n' <<< "$CHUNKS" | wc -l) \
  * $(tr ',' '\n' <<< "$LONGSHORT_ORDER" | wc -l) ))
LONGSHORT_LIMIT=${LONGSHORT_LIMIT:-$(( 80 + LONGSHORT_RUNS * (DURATION + 12) ))}
SAT_MODES=${SAT_MODES:-off pipeline}
SAT_MAX=${SAT_MAX:-1000}
SAT_ARGS=${SAT_ARGS:---quantization fp8 --kv-cache-dtype fp8}
START=$SECONDS
LOG=$OUT/gpu_mixed.log
BENCH_LOG=$OUT/bench.log
stamp() { echo "[gpu_mixed +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
left() { echo $((BUDGET - (SECONDS - START))); }
# limit CAP RESERVE: at most CAP seconds, and never into the RESERVE seconds the later parts need
limit() { local l=$(( $(left) - $2 )); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 10 ] && l=10; echo "$l"; }

SMOKE_ARGS=(); MIXED_ARGS=(--profile)
read -r -a TESTS <<< "${TEST_FILES:-tests/gpu/test_mixed_gpu.py tests/gpu/test_flash_attn4_gpu.py}"
MODEL=(--model random:llama-3-8b --device cuda)
# The GPU machine runs the hack scripts as modules from the root; a smoke run here runs them as files from /tmp
# (where a developer's tools run, the root's operator/ must not shadow the standard library's).
PY=python3; RUN_DIR=$ROOT; PROFILE=(python3 -m hack.profile_mixed); CLI=(python3 -m metronome.cli)
AB=(python3 -m hack.bench_attention)
if [ "${SMOKE:-0}" = 1 ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  RUN_DIR=/tmp; PROFILE=("$PY" "$ROOT/hack/profile_mixed.py"); CLI=("$PY" -m metronome.cli); TESTS=()
  MODEL=(--model random:tiny --device cpu --dtype float32 --num-kv-blocks 512)
  SMOKE_ARGS=(--long-prompt-len 60 --short-prompt-len 8 --output-len 4)
  MIXED_ARGS=(--smoke); CHUNKS=16,32; DURATION=1; MIXED_CHUNKS=16,32; SAT_MAX=8; SAT_ARGS=
fi

# --- wheels: join the libs-cu13 wheel, check it, install everything the image lacks
WH=/tmp/metronome-wheels
mkdir -p "$WH"
CALL2=.fa4wheels/call2
if [ -d "$CALL2" ] && [ "${SMOKE:-0}" != 1 ]; then
  for sum in "$CALL2"/*.sha256; do
    [ -e "$sum" ] || continue
    name=$(basename "$sum" .sha256)
    if [ -e "/tmp/fa4/$name.part0" ] && [ -e "$CALL2/$name.part1" ]; then
      cat "/tmp/fa4/$name.part0" "$CALL2/$name.part1" > "/tmp/fa4/$name"
      (cd /tmp/fa4 && sha256sum -c "$ROOT/$sum" >> "$LOG" 2>&1) || { stamp "$name: checksum mismatch"; rm -f "/tmp/fa4/$name"; }
    else
      stamp "$name: part0 not in /tmp/fa4 (the first call did not run on this machine): FA4 stays absent"
    fi
  done
  WHEELS=("$CALL2"/*.whl)
  [ -n "$(ls /tmp/fa4/*.whl 2>/dev/null)" ] && WHEELS+=(/tmp/fa4/*.whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WH" \
    "${WHEELS[@]}" >> "$LOG" 2>&1 || stamp "pip install failed (see above)"
fi
if ls .gpuwheels/*.whl >/dev/null 2>&1 && [ "${SMOKE:-0}" != 1 ]; then  # pydantic and the rest the image lacks
  python3 -m pip install --no-deps --no-index -q --no-compile --target "$WH" .gpuwheels/*.whl >> "$LOG" 2>&1 \
    || stamp "pip install of .gpuwheels failed (see above)"
fi
# nvidia-cutlass-dsl puts its packages on sys.path with a .pth file, which a --target folder does not run.
export PYTHONPATH=$WH:$WH/nvidia_cutlass_dsl/dsl_packages:$ROOT/tests/support
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-jit
stamp "wheels installed"
(cd "$RUN_DIR" && "$PY" -) <<'EOF' 2>&1 | tee -a "$LOG"
import importlib, sys
for mod in ("torch", "triton", "pydantic", "cutlass", "flash_attn.cute", "metronome.server.engine.engine"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod}: {getattr(m, '__version__', 'ok')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{mod}: MISSING ({type(exc).__name__}: {exc})")
import torch
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA", "python", sys.version.split()[0])
EOF

# --- 1. GPU tests
if has tests && [ ${#TESTS[@]} -gt 0 ]; then
  stamp "GPU tests (limit $(limit "$TEST_LIMIT" 340)s)"
  timeout -k 5 "$(limit "$TEST_LIMIT" 340)" python3 -m pytest "${TESTS[@]}" -q -s -p no:cacheprovider -o addopts="" \
    --durations=8 ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu-tests.log" 2>&1
  stamp "GPU tests rc=$?: $(tail -n 1 "$OUT/gpu-tests.log")"
fi

# --- 2. the mixed step: whole vs overlapped vs split, chunks 128/512/2048, against its floor, with the overlap
if has mixed; then
  MIXED_RESERVE=0; has longshort && MIXED_RESERVE=220  # what the long-short and the A/B after it need
  stamp "mixed-step profile (limit $(limit "$MIXED_LIMIT" $MIXED_RESERVE)s)"
  (cd "$RUN_DIR" && timeout -k 10 "$(limit "$MIXED_LIMIT" $MIXED_RESERVE)" "${PROFILE[@]}" "${MIXED_ARGS[@]}" --reps 2 \
    --variants "$VARIANTS" --chunks "$MIXED_CHUNKS" --out "$OUT/mixed.json") >> "$BENCH_LOG" 2>&1
  stamp "mixed-step profile rc=$?"
  grep -E "^ *[0-9]+ (whole|overlap|split|pipeline)|^profile|compiles" "$BENCH_LOG" | tail -n 24 | tee -a "$LOG"
fi

# --- 3. long-short, overlap off and on back to back per (chunk, rate)
if has longshort; then
  stamp "long-short (rates $RATES, chunks $CHUNKS, ${DURATION}s each, limit $(limit "$LONGSHORT_LIMIT" 50)s)"
  (cd "$RUN_DIR" && timeout -k 10 "$(limit "$LONGSHORT_LIMIT" 50)" "${CLI[@]}" bench engine "${MODEL[@]}" --no-progress \
    --sections longshort --rates "$RATES" --chunk-sizes "$CHUNKS" --duration "$DURATION" --warmup-requests 8 \
    --drain-timeout 10 --no-records --no-prefix-caching --mixed-overlap-variants "$LONGSHORT_ORDER" "${SMOKE_ARGS[@]}" \
    --out "$OUT/longshort.json") >> "$BENCH_LOG" 2>&1
  stamp "long-short rc=$?"
  (cd "$RUN_DIR" && "$PY" - "$OUT/longshort.json") <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as exc:  # noqa: BLE001
    sys.exit(f"no long-short JSON ({exc})")
for run in doc["longshort"]["runs"]:  # whether TBT p99 is the per-gap step p99 (no token waits two steps)
    steps, tbt = run["params"]["steps"], run["summary"]["tbt"]
    gen2 = steps.get("gc_pauses", {}).get("gen2", {})
    print(f"{run['label']}: TBT p99 {tbt['p99_ms']:.1f} ms; steps p99 {steps.get('step_ms_p99') or 0:.1f}, per gap "
          f"{steps.get('step_ms_p99_per_gap') or 0:.1f}, max {steps.get('step_ms_max') or 0:.1f} ms; full "
          f"collections {gen2.get('collections', 0)} (longest {gen2.get('max_ms', 0):.1f} ms)")
for r in doc["longshort"].get("overlap_comparison", []):
    drop = r["tbt_p99_reduction"]
    change = "-" if drop is None else f"{100 * abs(drop):.0f}% {'lower' if drop >= 0 else 'higher'}"
    print(f"chunk {r['chunk_size']} @ {r['rate']:g} req/s: TBT p99 off {r['tbt_p99_ms_off']:.1f} on "
          f"{r['tbt_p99_ms_on']:.1f} ms ({change}), tok/s off "
          f"{r['output_tokens_per_s_off']:.0f} on {r['output_tokens_per_s_on']:.0f}, completed {r['completed']}")
EOF
fi

# --- 4. FA4 vs Triton per batch class: the `auto` table
if has fa4ab && [ "${SMOKE:-0}" != 1 ]; then
  stamp "FA4 vs Triton A/B (limit $(limit 60 0)s)"
  timeout -k 5 "$(limit 60 0)" "${AB[@]}" --out "$OUT/attention_table.json" >> "$BENCH_LOG" 2>&1
  stamp "FA4 A/B rc=$?"
  grep -E "^(decode|chunk|mixed)_|^choice" "$BENCH_LOG" | tail -n 8 | tee -a "$LOG"
fi
# --- 5. saturation, one engine per overlap mode
if has saturation; then
  for mode in $SAT_MODES; do
    stamp "saturation, overlap $mode (limit $(limit 280 0)s)"
    # shellcheck disable=SC2086  # SAT_ARGS is a list of flags
    (cd "$RUN_DIR" && timeout -k 10 "$(limit 280 0)" "${CLI[@]}" bench engine "${MODEL[@]}" --no-progress \
      --sections saturation --saturation-max-requests "$SAT_MAX" --mixed-overlap "$mode" $SAT_ARGS \
      --out "$OUT/saturation-$mode.json") >> "$BENCH_LOG" 2>&1
    stamp "saturation $mode rc=$?"
    (cd "$RUN_DIR" && "$PY" - "$OUT/saturation-$mode.json") <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
try:
    sat = json.load(open(sys.argv[1]))["saturation"]
except Exception as exc:  # noqa: BLE001
    sys.exit(f"no saturation JSON ({exc})")
print({k: v for k, v in sat.items() if not isinstance(v, (list, dict))})
EOF
  done
fi
grep -h -i "warning\|error\|Traceback" "$BENCH_LOG" "$OUT/gpu-tests.log" 2>/dev/null | sort | uniq -c | sort -rn \
  | head -15 | tee -a "$LOG"
stamp "done"

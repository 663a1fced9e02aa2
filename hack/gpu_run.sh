#!/usr/bin/env bash
# The GPU calls: GPU tests, the mixed-step profile, and `metronome bench engine` on random:llama-3-8b (bf16) in
# pieces, each with its own time limit, all inside one 10-minute device call. Run from the repository root on the
# GPU machine with the git-ignored .gpuwheels/ carried along (pydantic and its needs, and llguidance for the
# constrained-decoding GPU tests: wheels the image lacks):
#
#     PARTS="tests" bash hack/gpu_run.sh                  # tests/gpu alone (TEST_LIMIT 540 s: ~5 min on a fresh machine)
#     PARTS="mixed a sat b eager" bash hack/gpu_run.sh    # the whole benchmark without the transformers peer (~6 min)
#     PARTS="sat hf" bash hack/gpu_run.sh                 # saturation, then the transformers comparison
#     bash hack/gpu_run.sh                                # default PARTS="mixed a sat b eager hf": hf with the time left
#     MODEL=random:qwen3-30b-a3b PARTS="a b" CHUNKS=512,2048 bash hack/gpu_run.sh   # another model (an MoE: no hf)
#     PARTS="moe" bash hack/gpu_run.sh                    # the MoE experts' microbenchmark alone (~4 min)
#
# Parts (what each leaves in $OUT, at most 8 files; everything else goes into $OUT/gpu-run.tgz):
#   tests   tests/gpu (-x -q), log in gpu-tests.log
#   mixed   hack/profile_mixed.py --profile: 64 decodes at 2k + a 512-token chunk, piecewise graphs vs eager vs
#           eager unfused, interleaved, against its floor, with launch counts → h200-mixed.json
#   a       bench sections device, decode (batch 1/16/64/256 at 2k context), prefill → parts a
#   sat     bench sections device, saturation: as many 1,000 + 1,000-token requests as the KV cache holds (~438 on
#           the H200, at most SAT_MAX; decode graphs captured up to it) at once, output tok/s vs its floor (SAT_LIMIT s)
#   b       bench longshort per chunk size and rate (RATES, DURATION s of arrivals each), prefix caching off; the figure (TBT p99 vs
#           throughput, and the TBT CDF) is drawn from the runs in memory, the JSON keeps no per-token records
#   eager   decode with --enforce-eager, for the graphs-vs-eager ratio
#   hf      the same 200-request batch through our engine (chunk 2048, compared, and 512) and transformers (only
#           with > 90 s left)
#   moe     hack/bench_moe.py: fused Triton MoE vs torch grouped_mm vs the per-expert loop at qwen3-30b-a3b,
#           gpt-oss-20b and mixtral-8x7b layer shapes, 1-2,048 tokens (MOE_LIMIT s) → moe-kernels.json
#   then:   h200-engine.json (a + sat + b + hf merged, targets), h200-tbt-vs-throughput.png, gpu_run.log, bench.log
# Knobs (environment): PARTS, BUDGET, MODEL, BATCHES, A_LIMIT, TEST_LIMIT, TESTS, RATES, DURATION, CHUNKS, SAT_MAX, SAT_LIMIT,
# HF_REQUESTS, HF_CHUNKS, HF_TIMEOUT, MOE_LIMIT, and SMOKE=1
# (tiny model on the CPU: checks this script's plumbing, not the GPU).
# (no `set -u`: empty option arrays would trip it on older bash)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
WORK=$(mktemp -d /tmp/gpu_run.XXXX)  # logs and part files; tarred into $OUT at the end
mkdir -p "$OUT"
PARTS=${PARTS:-mixed a sat b eager hf}
MODEL=${MODEL:-random:llama-3-8b}
BATCHES=${BATCHES:-1,16,64,256}
MOE_LIMIT=${MOE_LIMIT:-360}
A_LIMIT=${A_LIMIT:-150}
TEST_LIMIT=${TEST_LIMIT:-540}
TESTS=${TESTS:-tests/gpu}
RATES=${RATES:-5,15,30,45,60}
DURATION=${DURATION:-3}
CHUNKS=${CHUNKS:-256,512,1024,2048,unchunked}
HF_REQUESTS=${HF_REQUESTS:-200}
HF_CHUNKS=${HF_CHUNKS:-2048,512}
SAT_MAX=${SAT_MAX:-512}
SAT_LIMIT=${SAT_LIMIT:-150}
HF_TIMEOUT=${HF_TIMEOUT:-60}
START=$SECONDS
LOG=$OUT/gpu_run.log
stamp() { echo "[gpu_run +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
BUDGET=${BUDGET:-570}  # seconds this script may take in all (the run tool stops a command at 600 s)
left() { echo $((BUDGET - (SECONDS - START))); }
limit() { local want=$1 l; l=$(left); [ "$l" -lt "$want" ] && want=$l; echo "$want"; }

# --- imports. The checkout is importable from its root as it is (metronome/__init__.py maps server/, kernels/ and
# operator/ into the package when run from a source tree): everything runs as `python3 -m` from the root, which puts
# the root on sys.path only after start-up, when the standard library's `operator` is loaded (the root on
# PYTHONPATH would let operator/ shadow it while `site` starts). Wheels the image lacks go to /tmp/metronome-wheels;
# tests/support (the test support package, which the GPU tests import: nothing there shadows anything) joins them.
WH=/tmp/metronome-wheels
mkdir -p "$WH"
if ls .gpuwheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install --no-deps --no-index -q --target "$WH" .gpuwheels/*.whl >> "$LOG" 2>&1
fi
export PYTHONPATH=$WH:$ROOT/tests/support
python3 - <<'EOF' 2>&1 | tee -a "$LOG"
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
if python3 -c "import matplotlib" 2>/dev/null; then PLOT=(--plot "$OUT/h200-tbt-vs-throughput.png"); fi
BENCH=(python3 -m metronome.cli bench engine --model "$MODEL" --device cuda --no-progress)
SMOKE_ARGS=()  # SMOKE=1: the same pieces on the CPU with a tiny model (checks this script, not the GPU)
MIXED_ARGS=(--profile)
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_ARGS=(--device cpu --model random:tiny --copy-mb 4 --matmul-size 64 --reps 2 --batch-sizes 1,3 --context 48
              --decode-steps 3 --prefill-prompt-len 40 --prefill-prompts 2 --prefill-chunk 128 --rates 30
              --chunk-sizes 16,unchunked --duration 1 --long-prompt-len 100 --short-prompt-len 10 --output-len 5
              --hf-requests 3 --warmup-requests 1 --skip-hf --saturation-prompt-len 20 --saturation-output-len 8
              --saturation-chunk-size 64)
  HF_CHUNKS=32,16
  SAT_MAX=6
  MIXED_ARGS=(--smoke)
fi

# --- tests/gpu
if has tests; then
  stamp "GPU tests $TESTS (limit $(limit "$TEST_LIMIT")s)"
  timeout -k 5 "$(limit "$TEST_LIMIT")" python3 -m pytest $TESTS -q -s -p no:cacheprovider -o addopts="" \
    > "$OUT/gpu-tests.log" 2>&1
  rc=$?
  stamp "GPU tests rc=$rc: $(tail -n 1 "$OUT/gpu-tests.log")"
fi

# --- the mixed step: piecewise graphs vs eager, against its floor, with launch counts
if has mixed; then
  stamp "mixed-step profile"
  timeout -k 10 "$(limit 150)" python3 -m hack.profile_mixed "${MIXED_ARGS[@]}" --out "$OUT/h200-mixed.json" \
    > "$WORK/mixed.log" 2>&1
  rc=$?; stamp "mixed-step profile rc=$rc"; tail -n 12 "$WORK/mixed.log" | tee -a "$LOG"
fi

# --- (a) device peaks, decode vs the HBM floor (CUDA graphs on), prefill
if has a; then
  stamp "bench part a: device,decode,prefill"
  timeout -k 10 "$(limit "$A_LIMIT")" "${BENCH[@]}" --sections device,decode,prefill --batch-sizes "$BATCHES" \
    --decode-steps 20 "${SMOKE_ARGS[@]}" --out "$WORK/h200-engine-a.json" > "$WORK/bench-a.log" 2>&1
  rc=$?; stamp "bench part a rc=$rc"
fi

# --- saturation: the KV cache full of 1,000 + 1,000-token requests, output tok/s against its floor
if has sat; then
  stamp "bench saturation (at most $SAT_MAX requests, limit $(limit "$SAT_LIMIT")s)"
  timeout -k 10 "$(limit "$SAT_LIMIT")" "${BENCH[@]}" --sections device,saturation --saturation-max-requests "$SAT_MAX" \
    "${SMOKE_ARGS[@]}" --out "$WORK/h200-engine-sat.json" > "$WORK/bench-sat.log" 2>&1
  rc=$?; stamp "bench saturation rc=$rc"; grep "^saturation" "$WORK/bench-sat.log" | tee -a "$LOG"
fi

# --- (b) long-short per chunk size at rates around saturation (runs of DURATION seconds of arrivals)
if has b; then
  stamp "bench part b: longshort (rates $RATES, ${DURATION}s each, chunks $CHUNKS)"
  # --no-prefix-caching: every run draws the same prompts (one seed), so with the cache on, every chunk size after
  # the first would find its prompts cached and prefill almost nothing (seen 2026-12-01: TTFT 12 ms, TBT flat).
  timeout -k 10 "$(limit 420)" "${BENCH[@]}" --sections longshort --rates "$RATES" --duration "$DURATION" \
    --chunk-sizes "$CHUNKS" --warmup-requests 8 --drain-timeout 10 --no-records --no-prefix-caching "${PLOT[@]}" \
    "${SMOKE_ARGS[@]}" --out "$WORK/h200-engine-b.json" > "$WORK/bench-b.log" 2>&1
  rc=$?; stamp "bench part b rc=$rc"
fi

# --- decode with CUDA graphs off, for the on/off comparison
if has eager; then
  stamp "bench eager decode"
  timeout -k 10 "$(limit 70)" "${BENCH[@]}" --sections decode --batch-sizes 1,64 --decode-steps 10 --enforce-eager \
    "${SMOKE_ARGS[@]}" --out "$WORK/h200-decode-eager.json" > "$WORK/bench-eager.log" 2>&1
  rc=$?; stamp "bench eager decode rc=$rc"
fi

# --- the same request batch through our engine and transformers' continuous batching, with what time is left
if has hf && [ "${SKIP_HF:-0}" != 1 ] && [ "$(left)" -gt 90 ]; then
  stamp "bench part c: hf ($HF_REQUESTS requests, transformers limit ${HF_TIMEOUT}s, $(left)s left)"
  timeout -k 5 "$(left)" "${BENCH[@]}" --sections hf --hf-requests "$HF_REQUESTS" --hf-timeout "$HF_TIMEOUT" \
    --batch-chunk-size "$HF_CHUNKS" "${SMOKE_ARGS[@]}" --out "$WORK/h200-engine-c.json" > "$WORK/bench-c.log" 2>&1
  rc=$?; stamp "bench part c rc=$rc"
fi

# --- the MoE experts' microbenchmark: fused Triton vs torch grouped_mm vs the per-expert loop
if has moe; then
  stamp "MoE kernels microbenchmark (limit $(limit "$MOE_LIMIT")s)"
  MOE_ENV=(); MOE_ARGS=()
  if [ "${SMOKE:-0}" = 1 ]; then MOE_ENV=(TRITON_INTERPRET=1); MOE_ARGS=(--smoke --tokens 2); fi
  timeout -k 10 "$(limit "$MOE_LIMIT")" env "${MOE_ENV[@]}" python3 -m hack.bench_moe "${MOE_ARGS[@]}" \
    --json "$OUT/moe-kernels.json" > "$WORK/bench-moe.log" 2>&1
  rc=$?; stamp "MoE kernels rc=$rc"; tail -n 40 "$WORK/bench-moe.log" | tee -a "$LOG"
fi

PARTS_JSON=()
for part in a sat b c; do [ -s "$WORK/h200-engine-$part.json" ] && PARTS_JSON+=("$WORK/h200-engine-$part.json"); done
if [ ${#PARTS_JSON[@]} -gt 0 ]; then
  EAGER=(); [ -s "$WORK/h200-decode-eager.json" ] && EAGER=(--eager "$WORK/h200-decode-eager.json")
  MIXED=(); [ -s "$OUT/h200-mixed.json" ] && MIXED=(--mixed "$OUT/h200-mixed.json")
  python3 -m hack.merge_engine_json "$OUT/h200-engine.json" "${PARTS_JSON[@]}" "${EAGER[@]}" "${MIXED[@]}" \
    2>&1 | tee -a "$LOG"
fi
cat "$WORK"/bench-*.log 2>/dev/null | grep -v "━\|┃" > "$OUT/bench.log"
grep -h -i "warning\|error\|Traceback" "$WORK"/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -20 | tee -a "$LOG"
stamp "done; packing the rest"
tar -czf "$OUT/gpu-run.tgz" -C "$WORK" . 2>/dev/null

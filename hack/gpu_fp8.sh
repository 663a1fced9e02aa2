#!/usr/bin/env bash
# The FP8 GPU call: tests, the GEMM choice per shape and batch, and `metronome bench engine` on random:llama-3-8b
# with FP8 weights and an FP8 KV cache against bf16 — one command, at most BUDGET seconds (default 540), every result
# as JSON in $OUT. Run from the repository root on the GPU machine (as hack/gpu_run.sh, with .gpuwheels/ carried):
#
#     bash hack/gpu_fp8.sh                       # everything (~9 min)
#     PARTS="tests gemm" bash hack/gpu_fp8.sh    # a subset
#
# Parts, in order (each with its own time limit, cut to what is left):
#   tests  tests/gpu/test_fp8_gpu.py: every layout's GEMM per CUDA path vs the float32 emulation, the FP8 kernels in
#          bf16, graph replay vs eager with FP8, FP8 vs bf16 accuracy on SmolLM2-135M (64 prompts x 64 tokens)
#          → fp8-tests.log, fp8-accuracy.json
#   fp8    one engine (FP8 weights, FP8 KV): device peaks (bf16 and FP8 matmul), decode at 2k context batch 1 and 64
#          vs the FP8 floor, prefill 8 x 2,048 at chunk 8,192, saturation (1,000 + 1,000-token requests, as many as
#          the KV cache holds up to SAT_MAX), long-short at RATES with chunks 256/512/1024/unchunked
#          → fp8-engine.json, fp8-tbt-vs-throughput.png
#   bf16   the same model in bf16: device, decode batch 1 and 64, prefill (the prefill ratio's denominator, same call)
#          → bf16-engine.json
#   gemm   hack/fp8_gemm_bench.py: bf16 vs each FP8 GEMM path at Llama-3-8B shapes and M = 1 … 8,192, timed as graph
#          replays with the weights from HBM (GEMM_ARGS, e.g. --skinny-sweep) → fp8-gemm.json
#   attn   hack/bench_kernels.py --kv-fp8 --sweep: the decode attention over an FP8 cache per tile config
#          → fp8-attention.json, and over a bf16 cache with its default tiles (in gpu_fp8.log)
#   profile  hack/profile_decode.py: a decode step's kernel time by kind and kernel, batch 1 and 64, per FP8 GEMM
#          path, against the bytes floor → decode-profile.json
#   then   fp8-summary.json (the issue's targets from the above), gpu_fp8.log
# Knobs (environment): PARTS, BUDGET, MODEL (the fp8 and bf16 parts' model: e.g. random:qwen3-30b-a3b, whose experts
# `--quantization fp8` quantises per row), TESTS_K (pytest -k of the tests part), KV (fp8|auto), RATES, DURATION,
# CHUNKS, SAT_MAX, GEMM_ROWS, GEMM_ARGS, FP8_SECTIONS, ATTN_CASES, ATTN_LIMIT, METRONOME_FP8_GEMM, and
# SMOKE=1 (the bench parts on the CPU with a tiny model: checks this script's plumbing, not the GPU).
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
WORK=$(mktemp -d /tmp/gpu_fp8.XXXX)
mkdir -p "$OUT"
PARTS=${PARTS:-tests fp8 bf16 gemm}
BUDGET=${BUDGET:-540}
KV=${KV:-fp8}
RATES=${RATES:-16,48}
DURATION=${DURATION:-3}
CHUNKS=${CHUNKS:-256,512,1024,unchunked}
SAT_MAX=${SAT_MAX:-512}
GEMM_ROWS=${GEMM_ROWS:-1,16,64,256,512,2048,8192}
GEMM_ARGS=${GEMM_ARGS:-}
FP8_SECTIONS=${FP8_SECTIONS:-device,decode,prefill,saturation,longshort}
ATTN_CASES=${ATTN_CASES:-decode}  # bench_kernels --cases: e.g. decode,lead64dec for mixed batches too
ATTN_LIMIT=${ATTN_LIMIT:-150}
START=$SECONDS
LOG=$OUT/gpu_fp8.log
stamp() { echo "[gpu_fp8 +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
left() { echo $((BUDGET - (SECONDS - START))); }
limit() { local want=$1 l; l=$(left); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }

WH=/tmp/metronome-wheels  # wheels the image lacks (see hack/gpu_run.sh)
mkdir -p "$WH"
if ls .gpuwheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install --no-deps --no-index -q --target "$WH" .gpuwheels/*.whl >> "$LOG" 2>&1
fi
export PYTHONPATH=$WH:$ROOT/tests/support  # the test support package the GPU tests import (as hack/gpu_run.sh)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" 2>&1 | tee -a "$LOG"
BENCH=(python3 -m metronome.cli bench engine --model "${MODEL:-random:llama-3-8b}" --device cuda --no-progress --skip-hf
       --no-records --context 2048 --batch-sizes 1,64 --decode-steps 20 --prefill-prompts 8 --prefill-prompt-len 2048
       --prefill-chunk 8192)
if [ "${SMOKE:-0}" = 1 ]; then  # the plumbing on the CPU with a tiny model (no tests, no GEMM paths)
  BENCH=(python3 -m metronome.cli bench engine --model random:tiny --device cpu --dtype float32 --no-progress
         --skip-hf --no-records --context 48 --batch-sizes 1,3 --decode-steps 3 --prefill-prompts 2
         --prefill-prompt-len 40 --prefill-chunk 128 --copy-mb 4 --matmul-size 64 --reps 2 --long-prompt-len 100
         --short-prompt-len 10 --output-len 5 --saturation-prompt-len 20 --saturation-output-len 8
         --saturation-chunk-size 64 --kv-cache-memory-gb 0.05)
  PARTS=${PARTS_SMOKE:-fp8 bf16}
  SAT_MAX=6
  DURATION=1
fi

if has tests; then
  stamp "tests/gpu/test_fp8_gpu.py (limit $(limit 170)s)"
  OUT=$OUT timeout -k 5 "$(limit 170)" python3 -m pytest tests/gpu/test_fp8_gpu.py -q -s -p no:cacheprovider \
    -o addopts="" --durations=5 ${TESTS_K:+-k "$TESTS_K"} > "$OUT/fp8-tests.log" 2>&1
  stamp "tests rc=$?: $(tail -n 1 "$OUT/fp8-tests.log")"
fi

if has fp8; then
  stamp "bench fp8 (weights fp8, kv $KV; limit $(limit 230)s)"
  PLOT=()  # the figure is drawn from the long-short runs
  case ",$FP8_SECTIONS," in *,longshort,*) python3 -c "import matplotlib" 2>/dev/null &&
    PLOT=(--plot "$OUT/fp8-tbt-vs-throughput.png");; esac
  timeout -k 10 "$(limit 230)" "${BENCH[@]}" --quantization fp8 --kv-cache-dtype "$KV" \
    --sections "$FP8_SECTIONS" --saturation-max-requests "$SAT_MAX" \
    --rates "$RATES" --duration "$DURATION" --chunk-sizes "$CHUNKS" --warmup-requests 8 --drain-timeout 10 \
    --no-prefix-caching "${PLOT[@]}" --out "$OUT/fp8-engine.json" > "$WORK/bench-fp8.log" 2>&1
  stamp "bench fp8 rc=$?"; grep -E "^(device|prefill|saturation)" "$WORK/bench-fp8.log" | tee -a "$LOG"
fi

if has bf16; then
  stamp "bench bf16 (limit $(limit 85)s)"
  timeout -k 10 "$(limit 85)" "${BENCH[@]}" --sections device,decode,prefill --out "$OUT/bf16-engine.json" \
    > "$WORK/bench-bf16.log" 2>&1
  stamp "bench bf16 rc=$?"; grep -E "^(device|prefill)" "$WORK/bench-bf16.log" | tee -a "$LOG"
fi

if has gemm && [ "$(left)" -gt 15 ]; then
  stamp "GEMM paths (limit $(limit 150)s)"
  # shellcheck disable=SC2086 # GEMM_ARGS is a list of flags
  timeout -k 5 "$(limit 150)" python3 -m hack.fp8_gemm_bench --rows "$GEMM_ROWS" --reps 10 $GEMM_ARGS \
    --out "$OUT/fp8-gemm.json" > "$WORK/gemm.log" 2>&1
  stamp "GEMM paths rc=$?"; grep -E "M=" "$WORK/gemm.log" | tee -a "$LOG"
fi

if has attn && [ "$(left)" -gt 15 ]; then
  stamp "FP8-cache attention sweep ($ATTN_CASES), then the bf16 cache's defaults (limit $(limit "$ATTN_LIMIT")s)"
  timeout -k 5 "$(limit "$ATTN_LIMIT")" python3 -m hack.bench_kernels --kv-fp8 --sweep --cases "$ATTN_CASES" \
    --json "$OUT/fp8-attention.json" > "$WORK/attn.log" 2>&1
  stamp "attention rc=$?"; grep -E "decode|best" "$WORK/attn.log" | tee -a "$LOG"
  timeout -k 5 "$(limit 40)" python3 -m hack.bench_kernels --cases "$ATTN_CASES" > "$WORK/attn-bf16.log" 2>&1
  grep -E "^decode" "$WORK/attn-bf16.log" | sed 's/^/bf16 cache: /' | tee -a "$LOG"
fi

if has profile && [ "$(left)" -gt 30 ]; then
  stamp "decode profile (limit $(limit 150)s)"
  timeout -k 5 "$(limit 150)" python3 -m hack.profile_decode --kv-cache-dtype "$KV" --out "$OUT/decode-profile.json" \
    > "$WORK/profile.log" 2>&1
  stamp "profile rc=$?"; grep -vE "^(USDT|STAGE|\[W)" "$WORK/profile.log" | tail -n 60 | tee -a "$LOG"
fi

has fp8 && python3 -m hack.fp8_summary "$OUT" 2>&1 | tee -a "$LOG"
cat "$WORK"/*.log > "$OUT/fp8-bench.log" 2>/dev/null
stamp "done"

#!/usr/bin/env bash
# One GPU call: the KV cache's pages token-major against head-major. The attention and KV-write kernels per batch
# class (bf16 and FP8 caches, interleaved rounds), then the FP8 engine (decode and saturation) once per layout.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
START=$SECONDS
stamp() { echo "[pages +$((SECONDS - START))s] $*"; }
WH=/tmp/metronome-wheels; mkdir -p "$WH"
ls .gpuwheels/*.whl >/dev/null 2>&1 && python3 -m pip install --no-deps --no-index -q --target "$WH" .gpuwheels/*.whl
export PYTHONPATH=$WH:$PWD/tests/support
CASES=${CASES:-decode_b16,decode_b64,decode_b256,decode_b1_16k,lead64dec_2k_chunk512,prefill_2048}
for kv in ${KERNEL_KVS-bf16 fp8}; do
  stamp "kernels, $kv cache"
  timeout -k 5 ${KERNEL_LIMIT:-100} python3 -m hack.bench_kernels --page-layout-ab 3 --cases "$CASES" \
    $([ $kv = fp8 ] && echo --kv-fp8) --json "$OUT/pages-kernels-$kv.json" 2>&1 | grep -vE "^\s*$" | tail -n 40
done
BENCH=(python3 -m metronome.cli bench engine --model random:llama-3-8b --device cuda --no-progress --skip-hf
       --no-records --context 2048 --batch-sizes 1,64 --decode-steps 20 --quantization fp8 --kv-cache-dtype fp8
       --sections "${SECTIONS:-device,decode,saturation}" --saturation-max-requests 1024)
for pages in ${ENGINE_ORDER:-head_major token_major}; do
  stamp "engine, $pages pages"
  METRONOME_KV_PAGES=$pages timeout -k 10 ${ENGINE_LIMIT:-200} "${BENCH[@]}" --out "$OUT/pages-engine-$pages.json" \
    > "$OUT/pages-engine-$pages.log" 2>&1; tail -n 12 "$OUT/pages-engine-$pages.log"
done
stamp done

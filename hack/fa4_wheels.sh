#!/usr/bin/env bash
# FlashAttention-4 and what it needs, as wheels for the GPU machine (Python 3.12, manylinux x86-64), laid out for
# two device calls: one call carries at most 64 MiB with the working tree, and nvidia-cutlass-dsl-libs-cu13 alone is
# 92 MB, so that wheel is cut in two. Run here, in the repository root (needs the package registry):
#
#     bash hack/fa4_wheels.sh          # -> .fa4wheels/call1 (~55 MB) and .fa4wheels/call2 (~50 MB), git-ignored
#
# Then, on one warm machine, two consecutive `run` calls (the machine stays warm ~30 s after a call):
#   1. carry [".fa4wheels/call1"] (the wheel's first 52 MiB, .part0), command:
#        mkdir -p /tmp/fa4 && cp .fa4wheels/call1/* /tmp/fa4/
#   2. carry [".fa4wheels/call2"], command: bash hack/gpu_mixed.sh   (it joins the parts, checks the sha256,
#      installs everything into /tmp/metronome-wheels and runs)
# The pydantic wheels (the image lacks pydantic) ride in call2 as well.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.fa4wheels
PY=${PYTHON:-.venv/bin/python}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
FA4=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
     nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
     apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5)
BASE=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0)
mkdir -p "$DIR/full" "$DIR/call1" "$DIR/call2"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$DIR/full" "${FA4[@]}" "${BASE[@]}"
rm -f "$DIR"/call1/* "$DIR"/call2/*
BIG=$(ls "$DIR"/full/nvidia_cutlass_dsl_libs_cu13-*.whl)
NAME=$(basename "$BIG")
split -b 52M -d -a 1 "$BIG" "$DIR/call1/$NAME.part"
mv "$DIR/call1/$NAME.part1" "$DIR/call2/"
(cd "$DIR/full" && sha256sum "$NAME") > "$DIR/call2/$NAME.sha256"
for wheel in "$DIR"/full/*.whl; do
  [ "$wheel" = "$BIG" ] || cp "$wheel" "$DIR/call2/"
done
du -sh "$DIR/call1" "$DIR/call2"

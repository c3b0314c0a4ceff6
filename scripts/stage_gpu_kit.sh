#!/usr/bin/env bash
# Lay out ../shared/gpu-vllm's wheels in parts that fit the device tool's 64 MiB carry limit beside this checkout.
#
# The device tool carries the working tree (tracked files) plus the paths named in `carry`, 64 MiB in all. The kit's
# prepare.sh cuts parts of 60 MiB, which stopped fitting once the checkout passed ~4 MiB (session 15: 66.9 MB by file
# sizes was refused, so the tool counts more than the files' bytes). This script runs a copy of prepare.sh whose part
# size is 64 MiB minus the tree minus a 4 MiB margin, into OUTDIR (git-ignored), and prints the `run` calls: parts
# 1..N-1 are copied into /tmp/parts, the last one also installs.
#   usage: bash scripts/stage_gpu_kit.sh [OUTDIR]      (default .gpu/s; the download cache .gpu/wheels is reused)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=${GPU_VLLM_KIT:-$ROOT/../shared/gpu-vllm}
OUT=${1:-.gpu/s}
[ -f "$KIT/prepare.sh" ] || { echo "stage_gpu_kit: no kit at $KIT (set GPU_VLLM_KIT)" >&2; exit 2; }
cd "$ROOT"
git check-ignore -q "$OUT" || { echo "stage_gpu_kit: $OUT must be git-ignored (add /.gpu/ to .git/info/exclude)" >&2; exit 2; }
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
limit=$(( (64 << 20) - tree - (4 << 20) ))
[ "$limit" -ge $((16 << 20)) ] || { echo "stage_gpu_kit: the checkout ($tree bytes) leaves under 16 MiB a part" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$KIT"/. "$tmp"/
sed -i "s/^LIMIT=.*/LIMIT=$limit/" "$tmp/prepare.sh"
mkdir -p "$OUT"
if [ -d .gpu/wheels ] && [ ! -e "$OUT/wheels" ]; then cp -al .gpu/wheels "$OUT/wheels"; fi
bash "$tmp/prepare.sh" "$OUT" | tail -1
n=$(find "$OUT" -maxdepth 1 -name 'part*' -type d | wc -l)
echo "checkout $((tree >> 10)) KiB; parts of at most $((limit >> 20)) MiB: $n calls"
for k in $(seq 1 "$n"); do
  if [ "$k" -lt "$n" ]; then
    echo "call $k: carry [\"$OUT/part$k\"]  mkdir -p /tmp/parts && cp $OUT/part$k/* /tmp/parts/"
  else
    echo "call $k: carry [\"$OUT/part$k\"]  mkdir -p /tmp/parts && cp $OUT/part$k/* /tmp/parts/ && bash /tmp/parts/install.sh >/dev/null 2>&1 && ..."
  fi
done

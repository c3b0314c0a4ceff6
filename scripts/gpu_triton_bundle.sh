#!/usr/bin/env bash
# Stage a newer Triton beside the GPU machine's pinned one (torch 2.11 pins Triton 3.6), for kernels that need it
# (rlkernel/backends/triton/gemm_cluster.py: Gluon's TMA multicast, Triton >= 3.8). Here (needs the package index):
#   bash scripts/gpu_triton_bundle.sh [VERSION]        # writes .gpu38/part1, .gpu38/part2 (git-ignored via .git/info/exclude)
# Then two `run` calls back to back (the machine keeps /tmp only while warm, ~30 s idle):
#   1: carry [".gpu38/part1"]:  mkdir -p /tmp/t38parts && cp .gpu38/part1/* /tmp/t38parts/
#   2: carry [".gpu38/part2"]:  cp .gpu38/part2/* /tmp/t38parts/ && bash .gpu38/part2/unpack.sh &&
#                              PYTHONPATH=/tmp/t38:$PWD python3 scripts/gpu_gemm_cluster.py --out $OUT ...
# The bundle drops what sm_90 kernels do not use (the AMD backend — also from the entry points, else Triton's
# backend discovery fails — CUPTI, proton, ptxas-blackwell: Triton 3.8 runs `ptxas` below sm_100); ~104 MB in xz.
set -euo pipefail
VER=${1:-3.8.0}
PY=${PYTHON:-.venv/bin/python}
W=$(mktemp -d)
"$PY" -m pip download --no-deps -d "$W" "triton==$VER" --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_27_x86_64 -q
mkdir -p "$W/x" && (cd "$W/x" && unzip -q "$W"/triton-*.whl)
(cd "$W/x" && rm -rf triton/backends/amd triton/backends/nvidia/lib/cupti* triton/backends/nvidia/bin/ptxas-blackwell \
    triton/_C/libproton.so && sed -i '/amd/d' triton-*.dist-info/entry_points.txt && tar cf - triton triton-*.dist-info \
    | xz -T0 -6 > "$W/t.tar.xz")
rm -rf .gpu38 && mkdir -p .gpu38/part1 .gpu38/part2
split -b 53000000 -d "$W/t.tar.xz" "$W/part."
if [ -e "$W/part.02" ]; then echo "bundle over two 53 MB parts: add a part and a call" >&2; exit 1; fi
mv "$W/part.00" .gpu38/part1/t38part.00 && mv "$W/part.01" .gpu38/part2/t38part.01
sha256sum "$W/t.tar.xz" | cut -c1-64 > .gpu38/part2/SHA
cat > .gpu38/part2/unpack.sh <<'EOS'
set -e
cd /tmp/t38parts && cat t38part.00 t38part.01 > t.tar.xz && echo "$(cat SHA)  t.tar.xz" | sha256sum -c
mkdir -p /tmp/t38 && tar xJf t.tar.xz -C /tmp/t38
EOS
grep -qx '/.gpu38/' .git/info/exclude 2>/dev/null || echo '/.gpu38/' >> .git/info/exclude
ls -la .gpu38/*
rm -rf "$W"

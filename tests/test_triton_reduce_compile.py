"""The tree-sum kernel (`backends/triton/reduce.py`) as Triton compiles it for the H200 (sm_90), on a machine without a
GPU (Triton ships its own ptxas), at every (C, R) that `tree_sum_rows` launches.

Claims:
1. the (log2 R, C) classes `_shape` gives along `tree_sum_rows`'s launch chain, for lengths up to 4M and m in {1, 2,
   64, 4096}, are the 23 of `CLASSES`, and a length up to 4,096 takes one launch, a million two: a new class is
   compiled and checked here before it ships;
2. every class compiles for sm_90 without spills (ptxas's own count);
3. no thread adds more than K + G - 2 summands (K = R*C/128 rows a block, G = R/K blocks): the first kernel split the
   whole [C, R] tile in registers, a column in every thread (R - 1 adds), and took 60 s to compile at C=1, R=4096 on
   the H200's host; it fails this from R = 256 on.
Compile seconds are the benchmark's (`scripts/bench_triton_compile.py`), never asserted here.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from rlkernel.backends.triton import reduce as R  # noqa: E402
from rlkernel.backends.triton.launch import cdiv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (log2 R, C): m == 1 folds one column, R up to 4,096; m > 1 up to 4,096 rows in one launch (R * C = 4,096, C <= 64),
# longer ones by 64 x 64 blocks
CLASSES = ({(b, 1) for b in range(1, 13)} | {(b, 64) for b in range(1, 7)}
           | {(b, 1 << (R.MAX_LOG2_ROWS - b)) for b in range(7, 12)})

_COMPILE = '''
import contextlib, io, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rlkernel.backends.triton import reduce as R

for log2r, c in json.loads(sys.argv[1]):
    src = ASTSource(R._tree_rows_kernel, R.TREE_ROWS_SIGNATURE, constexprs={"C": c, "R": 1 << log2r, "LOG2R": log2r})
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG: ptxas -v's report, printed by Triton
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": R.NUM_WARPS})
    print(json.dumps({"log2r": log2r, "c": c, "ptxas": log.getvalue(), "ptx": k.asm["ptx"]}))
'''


def _launches(n: int, m: int) -> list[tuple[int, int]]:
    """The (log2 R, C) of each launch `tree_sum_rows` makes for an [n, m] tensor."""
    out = []
    while n > 1:
        log2r, c = R._shape(n, m)
        out.append((log2r, c))
        n = cdiv(n, 1 << log2r)
    return out


def test_the_launched_classes_are_the_listed_ones():
    lengths = sorted({v for b in range(23) for v in (1 << b, (1 << b) + 1)} | {1000, 4095, 10**6, 3 * 10**6})
    seen = {cls for n in lengths for m in (1, 2, 64, 4096) for cls in _launches(n, m)}
    assert seen == CLASSES, (seen - CLASSES, CLASSES - seen)
    assert all(len(_launches(n, m)) == 1 for n in (2, 100, 4096) for m in (1, 2, 64, 4096))
    assert len(_launches(10**6, 1)) == 2 and len(_launches(10**6, 64)) == 3


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """{(log2 R, C): (ptxas report, PTX)} of every class, compiled into a fresh cache (a cached one has no report)."""
    try:  # a Triton build without its ptxas cannot target sm_90 here: a skip, not a finding
        from triton import knobs

        ptxas = knobs.nvidia.ptxas.path
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no ptxas for sm_90 here: {str(e)[:200]}")
    if not ptxas or not os.path.exists(ptxas):
        pytest.skip("no ptxas for sm_90 here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton_cache")), TRITON_DUMP_PTXAS_LOG="1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(sorted(CLASSES))], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        rec = json.loads(line)
        out[(rec["log2r"], rec["c"])] = (rec["ptxas"], rec["ptx"])
    return out


def test_every_class_compiles_for_sm90_without_spills(compiled):
    assert set(compiled) == CLASSES
    for cls, (report, _) in sorted(compiled.items()):
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills, (cls, report[-500:])
        assert spills.groups() == ("0", "0"), (cls, spills.group(0))


def test_no_thread_adds_more_than_its_share(compiled):
    threads = 32 * R.NUM_WARPS
    for (log2r, c), (_, ptx) in sorted(compiled.items()):
        k = max(((1 << log2r) * c) // threads, 1)
        g = (1 << log2r) // k
        adds = len(re.findall(r"^\s*add(?:\.rn)?\.f32\s", ptx, flags=re.M))
        assert 0 < adds <= k + g - 2, ((log2r, c), adds, k + g - 2)

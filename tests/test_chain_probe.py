"""scripts/gpu_chain_probe.py on the CPU under TRITON_INTERPRET=1: the probe's slicing, its stored-accumulator hand-off
and its masks (M not a multiple of the tile), with exact integer sums, so that any indexing error shows as another
value. The claim the probe exists for (wgmma's chain continued from a stored accumulator keeps its bits) needs sm_90:
`python3 scripts/gpu_chain_probe.py --out DIR` on a GPU. Negative control: the slices without the hand-off (each from
+0.0, the last one alone) are not the GEMM."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
_ENV = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}


def test_the_probe_hands_the_accumulator_on():
    r = subprocess.run([sys.executable, "scripts/gpu_chain_probe.py", "--small", "--device", "cpu"], cwd=ROOT, env=_ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(row["M"], row["K"], row["N"]) for row in report["rows"]] == [(5, 256, 64), (33, 256, 64)]
    assert report["all"] == {"one_launch": True, "chained_2": True, "chained_4": True, "chained_8": True}


def test_without_the_hand_off_the_slices_are_not_the_gemm():
    code = textwrap.dedent('''
        import sys, torch
        sys.path.insert(0, "scripts")
        import gpu_chain_probe as P
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-3, 4, (33, 256), generator=g).float()
        w = torch.randint(-3, 4, (64, 256), generator=g).float()
        ref = (a.double() @ w.double().T).float()
        acc = None
        for ar, wr in P.slices(a, w, 4):
            last = P.chain(ar, wr, None, (16, 16, 16))  # no hand-off: each slice from +0.0
            acc = P.chain(ar, wr, acc, (16, 16, 16))
        print(P.same_bits(acc, ref), P.same_bits(last, ref))
    ''')
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "False"]

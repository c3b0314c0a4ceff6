"""scripts/gpu_attn_sweep.py's variant kernel, on the CPU under TRITON_INTERPRET=1: each knob the sweep times on the
H200 keeps production's arithmetic (the sweep's own bit check there is the same comparison at full size), so a change
to production's walk that the variant does not follow shows here first. Tiny tiles: 16-row tiles (8 tokens x G = 2),
8-key chunks, 16-key segments, packed lengths crossing every segment and tile edge; each variant against production
at the same tiles."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import sys
    from dataclasses import replace
    import torch
    sys.path.insert(0, "scripts")
    import gpu_attn_sweep as S
    from rlkernel.backends.triton import attention as A, contracts as C
    torch.manual_seed(0)
    lens = [40, 7, 33, 1, 64]
    hq, hkv, d = 4, 2, 16
    T, L = sum(lens), max(lens)
    q, k, v = torch.randn(T, hq, d), torch.randn(T, hkv, d), torch.randn(T, hkv, d)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    checked = 0
    for name in ("prodlike", "noloadmask", "plainalpha", "tma_plain", "tma_plain_nested", "tma_plain_m128w8",
                 "seg4096_oneseg_tma", "n128_tma_m128w8"):
        kw = dict(S.VARIANTS[name])
        kw["block_m"] = kw.get("block_m", 64) // 4
        kw["block_n"] = kw.get("block_n", 64) // 8
        kw["seg_keys"] = 16 if kw.get("seg_keys", 512) == 512 else 64
        # production at the variant's row tile too: on the GPU the tile's rows are independent wgmma chains (the sweep
        # compares 128-row variants with 64-row production there), but the interpreter's numpy dot need not be
        cfg = replace(C.ATTENTION, block_m=kw["block_m"], block_n=kw["block_n"], seg_keys=kw["seg_keys"])
        ref = A.attention_varlen(q, k, v, cu, max_seqlen=L, config=cfg, split=False)
        y = S.variant_call(S._var_fwd, q, k, v, cu, L, **kw)
        assert torch.equal(y, ref), name
        checked += 1
    # negative control: another chunk size is another order (the comparison can fail)
    other = A.attention_varlen(q, k, v, cu, max_seqlen=L, config=replace(C.ATTENTION, block_m=16, block_n=16, seg_keys=16))
    assert not torch.equal(other, A.attention_varlen(q, k, v, cu, max_seqlen=L,
                                                     config=replace(C.ATTENTION, block_m=16, block_n=8, seg_keys=16)))
    print("ok", checked)
''')


def test_the_sweeps_variant_kernel_keeps_productions_arithmetic_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok 8"), p.stderr[-3000:]

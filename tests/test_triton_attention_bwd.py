"""The Triton attention backward (rlkernel/backends/triton/attention_bwd.py) under
TRITON_INTERPRET=1 on the CPU, at tiny sizes (Hq=4, Hkv=2, D=16, packed lengths [29, 3, 17]).
It claims:

1. correctness against code we did not write: dq, dk, dv match torch autograd through
   F.scaled_dot_product_attention per sequence (fp32 1e-4 for two tilings and the default
   config; fp16 1e-2, as bf16 dots are wrong in this interpreter), and the forward's lse matches
   torch.logsumexp of the scaled causal scores; return_lse changes no output bit, and the
   split and unsplit forward give the same lse bits;
2. run to run: two calls give the same bits (no atomics, fixed walks);
3. batch invariance: a sequence's forward + backward alone, or packed in another order, gives
   the bits it gets inside the packed batch (torch.equal);
4. a host bound on the longest sequence (`max_seqlen`, exact or larger; the trainer's hint that spares a read-back
   a layer) gives the same bits, forward and backward, also through the op's autograd node;
5. a GQA group that does not divide the tiles (G = 3) is computed right (against torch) and alone == packed.

Negative control for 3: a second tiling gives different bits for the same inputs (while still
matching torch), so the equalities in 3 are not equal by accident of the data. The
interpreter is numpy, so this proves the walks and masks, not the GPU's bits.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import interpreter_env

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None

_SCRIPT = textwrap.dedent('''
    import dataclasses, torch
    import torch.nn.functional as F
    import rlkernel.backends.triton as rk
    from rlkernel.backends.triton.attention_bwd import AttentionBwdConfig
    torch.manual_seed(0)
    hq, hkv, d, lens = 4, 2, 16, [29, 3, 17]
    G = hq // hkv
    bounds = [(0, 29), (29, 32), (32, 49)]
    cu = torch.tensor([0, 29, 32, 49])
    q, k, v, dout = torch.randn(49, hq, d), torch.randn(49, hkv, d), torch.randn(49, hkv, d), torch.randn(49, hq, d)
    fcfg = dataclasses.replace(rk.contracts.ATTENTION, block_m=8, block_n=8, seg_keys=16, page_size=4)
    cfg_a = AttentionBwdConfig(block_m=8, block_n=16, dq_block_m=8, dq_block_n=8, num_warps=4, num_stages=1)
    cfg_b = AttentionBwdConfig(block_m=16, block_n=8, dq_block_m=16, dq_block_n=16, num_warps=4, num_stages=1)

    def fwd_bwd(q, k, v, dout, cu, cfg, split=None):
        out, lse = rk.attention_varlen(q, k, v, cu, config=fcfg, split=split, return_lse=True)
        return (out, lse, *rk.attention_varlen_backward(q, k, v, out, lse, dout, cu, config=cfg))

    packed = fwd_bwd(q, k, v, dout, cu, cfg_a)
    out, lse, dq, dk, dv = packed
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32 and lse.shape == (49, hq)

    # 1. return_lse changes no output bit; split and unsplit agree on lse bits
    assert torch.equal(out, rk.attention_varlen(q, k, v, cu, config=fcfg))
    out_s, lse_s = rk.attention_varlen(q, k, v, cu, config=fcfg, split=True, return_lse=True)
    assert torch.equal(out_s, out) and torch.equal(lse_s, lse)

    # 1. against torch autograd: two tilings, the default config, and fp16 (the rounded P and dS path)
    other = fwd_bwd(q, k, v, dout, cu, cfg_b)
    runs = [(packed, 1e-4), (other, 1e-4), (fwd_bwd(q, k, v, dout, cu, None), 1e-4),
            (fwd_bwd(*(x.half() for x in (q, k, v, dout)), cu, cfg_a), 1e-2)]
    assert all(x.dtype == torch.float16 for x in runs[-1][0][2:])
    for a, b in bounds:
        n = b - a
        qs = q[a:b].transpose(0, 1).clone().requires_grad_()
        ks = k[a:b].transpose(0, 1).clone().requires_grad_()
        vs = v[a:b].transpose(0, 1).clone().requires_grad_()
        kr, vr = ks.repeat_interleave(G, 0), vs.repeat_interleave(G, 0)
        ref = F.scaled_dot_product_attention(qs, kr, vr, is_causal=True)
        ref.backward(dout[a:b].transpose(0, 1))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        s = (qs @ kr.transpose(1, 2)).detach() * d ** -0.5
        ref_lse = torch.logsumexp(s.masked_fill(~causal, float("-inf")), -1).transpose(0, 1)
        for res, tol in runs:
            got = [x[a:b].float() for x in res]
            want = [ref.detach().transpose(0, 1), ref_lse, qs.grad.transpose(0, 1), ks.grad.transpose(0, 1),
                    vs.grad.transpose(0, 1)]
            for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                err = (g - w).abs().max().item()
                assert err < tol, (a, name, err, tol)

    # 2. run to run
    again = fwd_bwd(q, k, v, dout, cu, cfg_a)
    assert all(torch.equal(x, y) for x, y in zip(packed, again))

    # 3. alone == packed, and packed in another order == packed
    for a, b in bounds:
        alone = fwd_bwd(q[a:b], k[a:b], v[a:b], dout[a:b], torch.tensor([0, b - a]), cfg_a)
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), alone, packed):
            assert torch.equal(x, y[a:b]), (a, name)
    order = [2, 0, 1]
    perm = torch.cat([torch.arange(*bounds[i]) for i in order])
    cu_p = torch.tensor([0, 17, 46, 49])
    shuffled = fwd_bwd(q[perm], k[perm], v[perm], dout[perm], cu_p, cfg_a, split=True)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), shuffled, packed):
        assert torch.equal(x, y[perm]), name

    # 4. a host bound on the longest sequence (max_seqlen: exact or larger) sizes the launch only: the same bits,
    # forward and backward, and through the op's autograd node (the hint the trainer passes, no read-back)
    for bound in (29, 40):
        out_b, lse_b = rk.attention_varlen(q, k, v, cu, config=fcfg, return_lse=True, max_seqlen=bound)
        assert torch.equal(out_b, out) and torch.equal(lse_b, lse), bound
        grads_b = rk.attention_varlen_backward(q, k, v, out, lse, dout, cu, config=cfg_a, max_seqlen=bound)
        assert all(torch.equal(x, y) for x, y in zip(grads_b, packed[2:])), bound
    from rlkernel.backends.triton import ops as O

    def via_op(**hint):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = O.attention("varlen", *leaves, cu, d ** -0.5, **hint)
        o.backward(dout)
        return (o.detach(), *(x.grad for x in leaves))

    assert all(torch.equal(x, y) for x, y in zip(via_op(max_query_len=40), via_op()))

    # 5. a GQA group that does not divide the tiles (G = 3: 6 query heads on 2 kv heads; dq tiles of 8 and 16 rows hold
    # 2 and 5 tokens plus padding rows): against torch autograd, and a sequence alone == inside the pack
    q3, dout3 = torch.randn(49, 6, d), torch.randn(49, 6, d)
    for cfg in (cfg_a, cfg_b):
        res3 = fwd_bwd(q3, k, v, dout3, cu, cfg)
        for a, b in bounds:
            qs = q3[a:b].transpose(0, 1).clone().requires_grad_()
            ks = k[a:b].transpose(0, 1).clone().requires_grad_()
            vs = v[a:b].transpose(0, 1).clone().requires_grad_()
            ref = F.scaled_dot_product_attention(qs, ks.repeat_interleave(3, 0), vs.repeat_interleave(3, 0), is_causal=True)
            ref.backward(dout3[a:b].transpose(0, 1))
            want = [ref.detach(), qs.grad, ks.grad, vs.grad]
            for name, g, w in zip(("out", "dq", "dk", "dv"), (res3[0], *res3[2:]), want):
                err = (g[a:b] - w.transpose(0, 1)).abs().max().item()
                assert err < 1e-4, ("G=3", a, name, err)
            alone = fwd_bwd(q3[a:b], k[a:b], v[a:b], dout3[a:b], torch.tensor([0, b - a]), cfg)
            assert all(torch.equal(x, y[a:b]) for x, y in zip(alone, res3)), ("G=3 alone", a)

    # negative control: the bits do depend on the tiling
    assert not all(torch.equal(x, y) for x, y in zip(packed[2:], other[2:]))
    print("ok")
''')


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_attention_backward_under_triton_interpreter():
    pytest.importorskip("torch")
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]

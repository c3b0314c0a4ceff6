"""Context parallelism's GPU path (rlkernel.parallel.context_parallel.triton_pieces_forward / _backward), checked:
`python scripts/check_cp_pieces.py DTYPE` on a GPU (float32 / bfloat16), and under Triton's interpreter in
`tests/test_cp_triton.py` (float32: the interpreter's bfloat16 is not the GPU's). Prints "ok DTYPE".

1. The forward: every CP rank's pieces in one launch of the packed kernel (attention.attention_pieces: queries that
   are the last rows of a sequence against the gathered keys) give the rows and lse of the packed forward
   (attention_varlen) bit for bit; the stream's padding rows are zeros.
2. The backward at CP=1 with one segment (the pieces are the sequences) is attention_varlen_backward's bits.
3. With token segments (S=2), CP=1 (two segments) and CP=2 (one a rank) give the same dq rows and key / value
   partials, bit for bit (a piece's virtual sequence depends on its segment alone).
4. The gradients match torch autograd (float64 SDPA) per sequence: the zero rows before a piece's queries add
   nothing and the queries sit at their positions (CP rank 1's pieces start past position 0)."""
import sys

import torch

from rlkernel.backends.triton import attention as A
from rlkernel.backends.triton.attention_bwd import attention_varlen_backward
from rlkernel.parallel import context_parallel as CP

dtype = getattr(torch, sys.argv[1])
dev = "cuda" if torch.cuda.is_available() else "cpu"
tol = 1e-4 if dtype == torch.float32 else 2e-2  # of the largest gradient's magnitude
torch.manual_seed(0)
hq, hkv, d, lens = 4, 2, 16, [29, 3, 20]
T, T_l = 56, 28  # the stream padded to CP=2 x 28
cu = torch.tensor([0, 29, 32, 52], device=dev)
q, k, v, g = (torch.randn(T, h, d, device=dev).to(dtype) for h in (hq, hkv, hkv, hq))
scale = d ** -0.5
out, lse = A.attention_varlen(q, k, v, cu, return_lse=True, max_seqlen=29)
# 1. forward: each CP rank's pieces == the packed forward's rows, out and lse
parts = [CP.triton_pieces_forward(q[r * T_l:(r + 1) * T_l], k, v, CP.pieces(cu, r * T_l, T_l), scale) for r in (0, 1)]
o_cp, l_cp = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
assert torch.equal(o_cp[:52], out[:52]) and torch.equal(l_cp[:52], lse[:52])
assert not o_cp[52:].any() and not l_cp[52:].any()
# 2. backward at CP=1, one segment: the pieces are the sequences -> attention_varlen_backward's bits
ref = attention_varlen_backward(q, k, v, out, lse, g, cu, scale=scale, max_seqlen=29)
one = CP.triton_pieces_backward(q, k, v, o_cp, l_cp, g, CP.pieces(cu, 0, T), scale)
for a, b in zip(one, ref):
    assert a.dtype == torch.float32 and torch.equal(a[:52].to(b.dtype), b[:52])
# 3. token segments S=2: CP=1 (two segments of 28) == CP=2 (one a rank), dq rows and the key partials' tree
def seg(j, qq, oo, ll, gg, off):
    qs, ql, fp, ks, kl = CP.pieces(cu, j * T_l, T_l)
    return CP.triton_pieces_backward(qq, k, v, oo, ll, gg, (qs + off, ql, fp, ks, kl), scale)
cp1 = [seg(j, q, o_cp, l_cp, g, j * T_l) for j in (0, 1)]
sl = lambda x, r: x[r * T_l:(r + 1) * T_l]
cp2 = [seg(r, sl(q, r), sl(o_cp, r), sl(l_cp, r), sl(g, r), 0) for r in (0, 1)]
assert torch.equal(cp1[0][0] + cp1[1][0], torch.cat([cp2[0][0], cp2[1][0]]))
for i in (1, 2):
    assert torch.equal(cp1[0][i] + cp1[1][i], cp2[0][i] + cp2[1][i])
# 4. values: against torch autograd per sequence (float64)
dq_s, dk_s, dv_s = (cp1[0][i] + cp1[1][i] for i in range(3))
for lo, hi in ((0, 29), (29, 32), (32, 52)):
    qq, kk, vv = (x[lo:hi].double().transpose(0, 1).requires_grad_() for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qq, kk.repeat_interleave(2, 0), vv.repeat_interleave(2, 0), is_causal=True)
    gq, gk, gv = torch.autograd.grad(o, (qq, kk, vv), g[lo:hi].double().transpose(0, 1))
    for got, want in ((dq_s, gq), (dk_s, gk), (dv_s, gv)):
        want = want.transpose(0, 1)
        assert (got[lo:hi] - want).abs().max() <= tol * want.abs().max(), (lo, hi)
print("ok", sys.argv[1])

"""Claim 1 (batch invariance): a row's strict result is bitwise identical whether it is
computed alone or among M = 1, 2, 3, 7, 16, 64, 257 rows, at any position among them —
for linear, rms_norm (with and without residual), swiglu, rope and linear_logprob, in
fp32 and bf16, with sizes that are multiples of no tile.

Negative controls on the same inputs, recorded and not asserted, in each strict test
(helpers.record_native: the native ops are other libraries', and another CPU's may happen to
agree): native fp32 linear and native fp32 linear_logprob changed a row's bits with M on the
CPUs this ran on, native SiLU with position at small widths; where the native op happens to
be invariant on this CPU (bf16 linear, rms_norm, SiLU at wide rows) the record says so. The asserted control is
that the order decides the bits: one K segment against the tree of S (fp32, in
`test_segment_partials_merged_by_the_tree_equal_the_segmented_linear`)."""
import pytest
import torch

import rlkernel as rk
from helpers import record_native, row_failures

pytestmark = pytest.mark.usefixtures("impl")  # each test: CPU kernels and torch composition

DTYPES = [torch.float32, torch.bfloat16]
K, N, I, V, H = 1000, 300, 1001, 1900, 72  # odd sizes: no tile divides them


def _linear_case(dtype, backend):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, K, generator=g).to(dtype)
    row = (torch.randn(1, K, generator=g).to(dtype),)
    return row_failures(lambda x: rk.linear(x, w, backend=backend), row, lambda m, gen: (torch.randn(m, K, generator=gen).to(dtype),))


def _norm_case(dtype, backend, residual):
    g = torch.Generator().manual_seed(2)
    w = (torch.rand(K, generator=g) + 0.5).to(dtype)

    def fn(x, r):
        out = rk.rms_norm(x, w, 1e-6, residual=r if residual else None, backend=backend)
        return out[0] if residual else out

    row = (torch.randn(1, K, generator=g).mul(3).to(dtype), torch.randn(1, K, generator=g).to(dtype))
    return row_failures(fn, row, lambda m, gen: (torch.randn(m, K, generator=gen).mul(3).to(dtype), torch.randn(m, K, generator=gen).to(dtype)))


def _swiglu_case(dtype, backend, width):
    g = torch.Generator().manual_seed(3)
    row = (torch.randn(1, width, generator=g).mul(4).to(dtype), torch.randn(1, width, generator=g).to(dtype))
    return row_failures(lambda a, b: rk.swiglu(a, b, backend=backend), row,
                        lambda m, gen: (torch.randn(m, width, generator=gen).mul(4).to(dtype), torch.randn(m, width, generator=gen).to(dtype)))


def _logprob_case(dtype, backend):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(V + 60, H, generator=g).to(dtype)  # 60 padding rows
    w[V:] = 1e4  # padding must never be read
    row = (torch.randn(1, H, generator=g).to(dtype), torch.tensor([V - 3]))
    return row_failures(lambda h, t: rk.linear_logprob(h, w, t, 0.7, vocab_size=V, backend=backend), row,
                        lambda m, gen: (torch.randn(m, H, generator=gen).to(dtype), torch.randint(0, V, (m,), generator=gen)))


def _rope_case(dtype, backend):
    g = torch.Generator().manual_seed(5)
    row = (torch.randn(1, 4, 64, generator=g).to(dtype), torch.tensor([1234]))
    return row_failures(lambda x, p: rk.rope(x, p, 1e6, backend=backend), row,
                        lambda m, gen: (torch.randn(m, 4, 64, generator=gen).to(dtype), torch.randint(0, 4000, (m,), generator=gen)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strict_linear_is_batch_invariant(dtype):
    assert _linear_case(dtype, "strict") == []
    record_native(f"F.linear {dtype} (M, position) pairs vs the row alone", len(_linear_case(dtype, "native")))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_strict_rms_norm_is_batch_invariant(dtype, residual):
    assert _norm_case(dtype, "strict", residual) == []
    record_native(f"native rms_norm {dtype} residual={residual} (M, position) pairs vs the row alone",
                  len(_norm_case(dtype, "native", residual)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [5, I])
def test_strict_swiglu_is_batch_invariant(dtype, width):
    assert _swiglu_case(dtype, "strict", width) == []
    record_native(f"native swiglu {dtype} width {width} (M, position) pairs vs the row alone",
                  len(_swiglu_case(dtype, "native", width)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strict_linear_logprob_is_batch_invariant(dtype):
    assert _logprob_case(dtype, "strict") == []
    record_native(f"native linear-logprob {dtype} (M, position) pairs vs the row alone",
                  len(_logprob_case(dtype, "native")))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strict_rope_is_batch_invariant(dtype):
    assert _rope_case(dtype, "strict") == []
    record_native(f"native rope {dtype} (M, position) pairs vs the row alone", len(_rope_case(dtype, "native")))


def test_negative_control_native_silu_vs_position_recorded_at_small_width():
    """Native SiLU: 257 rows of width 5, each computed alone vs inside the batch (recorded); the strict side asserted."""
    g = torch.Generator().manual_seed(6)
    gate, up = torch.randn(257, 5, generator=g) * 4, torch.randn(257, 5, generator=g)
    batched = rk.swiglu(gate, up, backend="native")
    alone = torch.cat([rk.swiglu(gate[i:i + 1], up[i:i + 1], backend="native") for i in range(257)])
    record_native("F.silu rows alone vs in a batch of 257", int((batched != alone).any(-1).sum()))
    strict = rk.swiglu(gate, up)
    assert torch.equal(strict, torch.cat([rk.swiglu(gate[i:i + 1], up[i:i + 1]) for i in range(257)]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strict_linear_columns_do_not_see_the_other_columns(dtype):
    """A column's bits do not depend on which other weight rows share the call: fused QKV
    or gate/up weights equal split ones, and a TP column shard equals the full layer."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(3000, K, generator=g).to(dtype), torch.randn(40, K, generator=g).to(dtype)
    full = rk.linear(x, w)
    for lo, hi in ((0, 1), (0, 3), (0, 8), (5, 17), (100, 612), (1000, 3000), (7, 2999)):
        assert torch.equal(rk.linear(x, w[lo:hi]), full[:, lo:hi]), (lo, hi)
    perm = torch.randperm(3000, generator=g)
    assert torch.equal(rk.linear(x, w[perm]), full[:, perm])


def test_segment_partials_merged_by_the_tree_equal_the_segmented_linear():
    """Row-parallel layout: per-rank K-slices' partials, merged by the canonical tree, give
    linear(x, w, k_segments=S) bit for bit, for every split of the S segments over ranks."""
    from rlkernel import canonical_tree_sum
    from rlkernel.ops.linear import canonical_segments, linear_segment_partials

    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(37, 1024, generator=g).bfloat16(), torch.randn(300, 1024, generator=g).bfloat16()
    S = canonical_segments(1024, 8)
    assert S == 8 and canonical_segments(72, 8) == 8 and canonical_segments(100, 8) == 4 and canonical_segments(99, 8) == 1
    full = rk.linear(x, w, k_segments=S)
    for tp in (1, 2, 4, 8):
        k = 1024 // tp
        parts = [p for r in range(tp) for p in linear_segment_partials(x[:, r * k:(r + 1) * k], w[:, r * k:(r + 1) * k], S // tp)]
        assert torch.equal(canonical_tree_sum(parts).to(x.dtype), full), tp
    xf, wf = x.float(), w.float()  # the segment tree is another order: visible in fp32 (bf16 rounding may hide it)
    assert not torch.equal(rk.linear(xf, wf, k_segments=1), rk.linear(xf, wf, k_segments=S))


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_vocab_table_equals_targeted_logprobs(dtype):
    """The full [T, V] table a rollout engine samples from holds, at every token, the bits the
    targeted op (the trainer's) computes for that token — for every row of the batch."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(V + 60, H, generator=g).to(dtype)
    h = torch.randn(5, H, generator=g).to(dtype)
    table = rk.linear_logprobs_full(h, w, 0.7, vocab_size=V)
    assert table.shape == (5, V) and table.dtype == torch.float32
    for v in (0, 1, 511, 512, 1023, V - 1):
        assert torch.equal(table[:, v], rk.linear_logprob(h, w, torch.full((5,), v), 0.7, vocab_size=V))
    # and so for a batch of random targets
    t = torch.randint(0, V, (5,), generator=g)
    assert torch.equal(table.gather(1, t[:, None])[:, 0], rk.linear_logprob(h, w, t, 0.7, vocab_size=V))

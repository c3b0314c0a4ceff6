"""rlkernel.tree_sum on the GPU: the balanced binary tree of adjacent pairs, in as few launches
as the length needs (two for a million summands), bit for bit the torch composition.

Why: the composition in `reference.primitives.tree_sum` costs two launches per tree level plus
a padding fill; a strict GRPO update of a 28-layer model ran about 15,000 of them (the global
grad norm sums every parameter by the tree, RMSNorm's weight gradient sums over tokens), which
made the update launch-bound on an H200 (`benchmarks/h200_update_profile.json`).

The order is the contract's, unchanged: the length n padded with +0.0 to P = next power of two,
then a[0::2] + a[1::2] until one is left. A program reads an aligned block of R = 2^b rows
(R <= P; rows past n read +0.0, exactly the padding) and folds it by the same adjacent pairs,
so it writes the block's subtree sum. The next launch folds those sums the same way: ceil(n/R)
padded to its next power of two is P/R, so the two trees are the same tree. Each add is one
IEEE float32 add of the same two operands as the composition's, hence the same bits (tests under
TRITON_INTERPRET=1 compare them with torch.equal; `scripts/gpu_strict_parity.py` on the GPU).

How a program folds its [C, R] tile, and why so: R = G blocks of K = R*C/128 rows (K = 1 when
the tile has at most 128 summands, one per thread). Load k of K reads row g*K + k of every block
g, a [C, G] tile of one summand per thread; `_subtree` adds whole tiles pairwise (rows 0..K/2-1
against K/2..K-1, recursively), which is for every block exactly the contract's first log2 K
levels; the G block sums then fold in registers (a reshape to [C, G/2, 2] and a split, G <= 128).
The first version loaded the [C, R] tile and split it log2 R times: Triton 3.6 lays that out
with a whole column in every thread (the store's [C] layout carried back through each split),
i.e. R - 1 adds of straight-line code per thread, and compiling it was LLVM's work on that code.
Compile seconds for sm_90, Triton 3.6, a cold cache, before -> after: on a 2-core CPU host
C=1 R=4096 55.6 -> 0.34, C=2 R=2048 27.0 (52 bytes of spills) -> 0.36, C=1 R=2048 13.0 -> 0.19,
C=4 R=1024 3.3 -> 0.33, C=1 R=1024 3.3 -> 0.14, the 23 (C, R) that `_shape` gives 106 -> 4.3 in
all; on the H200's host C=1 R=4096 69.6 (first launch) -> 0.55, all 23 -> 7.7 (a one-off check there:
equal bits to the composition at every class and 73 shapes). The kernel also got faster there
(one launch, device time: 4,096 x 1 8.4 -> 3.6 us, 3,000 x 1,024 59 -> 20 us, 10^6 x 64 63 -> 62
us). A thread now does at most K + G - 2 adds (tests/test_triton_reduce_compile.py). The [C, G]
loads hold 128 summands, which Triton counts as expensive to rematerialise, so the split's
layout change stays after `_subtree` instead of being carried back to the loads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from .launch import fast, cdiv

MAX_LOG2_ROWS = 12  # rows folded per program (R <= 4096): a million summands take two launches
NUM_WARPS = 4
THREADS = tl.constexpr(32 * NUM_WARPS)  # a program's threads: one summand each per load of a [C, G] tile


@triton.jit
def _fold(x, C: tl.constexpr, HALF: tl.constexpr):
    """[C, 2*HALF] -> [C, HALF]: column j is x[:, 2j] + x[:, 2j+1]."""
    a, b = tl.split(tl.reshape(x, (C, HALF, 2)))
    return a + b


@triton.jit
def _subtree(x_ptr, rows, cols, n, m, K: tl.constexpr):
    """[C, G]: the tree over rows rows[g] .. rows[g] + K - 1 of column cols[c] (+0.0 past n), as K loads of [C, G] and
    pairwise adds of whole tiles: the first K/2 rows' tree plus the last K/2 rows' tree."""
    if K == 1:
        mask = (cols[:, None] < m) & (rows[None, :] < n)
        return tl.load(x_ptr + rows[None, :] * m + cols[:, None], mask=mask, other=0.0)
    else:
        return _subtree(x_ptr, rows, cols, n, m, K // 2) + _subtree(x_ptr, rows + K // 2, cols, n, m, K // 2)


@triton.jit(do_not_specialize=["n", "m", "col_blocks"])  # few compiled variants: the shapes vary every step
def _tree_rows_kernel(x_ptr, y_ptr, n, m, col_blocks, C: tl.constexpr, R: tl.constexpr, LOG2R: tl.constexpr):
    """x [n, m] row-major float32 -> y [ceil(n/R), m]: y[i, c] = the tree over x[i*R:(i+1)*R, c]. One grid axis (a
    second one is capped at 65,535 programs: an 8B model's embedding alone has 152k blocks of rows). The R rows go as
    G = R / K blocks of K: the blocks' trees by `_subtree` (K = 1 when the tile has no more summands than threads),
    then their G sums by `_fold` in registers."""
    K: tl.constexpr = R * C // THREADS if R * C > THREADS else 1
    G: tl.constexpr = R // K
    pid = tl.program_id(0).to(tl.int64)
    pid_r = pid // col_blocks
    pid_c = pid % col_blocks
    cols = pid_c * C + tl.arange(0, C)
    x = _subtree(x_ptr, pid_r * R + tl.arange(0, G) * K, cols, n, m, K)  # [C, G]
    for i in tl.static_range(LOG2R):
        if (G >> i) > 1:
            x = _fold(x, C, G >> (i + 1))
    out = tl.reshape(x, (C,))
    tl.store(y_ptr + pid_r * m + cols, out, mask=cols < m)


# _tree_rows_kernel's argument types for an ahead-of-time compile (scripts/bench_triton_compile.py, the compile tests)
TREE_ROWS_SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "m": "i32", "col_blocks": "i32", "C": "constexpr",
                       "R": "constexpr", "LOG2R": "constexpr"}


def _shape(n: int, m: int) -> tuple[int, int]:
    """(log2 R, C) for one launch of about 4,096 summands a program, R never past the padded length P. A length of up
    to 4,096 takes one launch: R = P, C = 4,096 / P columns (at most 64); longer ones go by R = 64 x C = 64 blocks (one
    column alone: R = 4,096), then the same rule on the block sums. The weight gradients of a strict update's 113
    RMSNorms are such short trees (a few thousand packed tokens): one launch each instead of two (session 23: the update
    is host-bound, 221 trees took two launches each). Few compiled variants: (C, R) is a function of P alone."""
    log2p = max(n - 1, 0).bit_length()
    if m == 1:
        return min(log2p, MAX_LOG2_ROWS), 1
    if log2p <= MAX_LOG2_ROWS:
        return log2p, min(64, 1 << (MAX_LOG2_ROWS - log2p))
    return 6, 64


def tree_sum_rows(x: torch.Tensor) -> torch.Tensor:
    """The tree over dim 0 of a float32 CUDA tensor [n, m] -> [m] (rlkernel.tree_sum's bits)."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"tree_sum_rows: needs a float32 [n, m] tensor, got {x.dtype} {tuple(x.shape)}")
    n, m = x.shape
    if n == 0:
        return torch.zeros(m, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    while n > 1:
        log2r, c = _shape(n, m)
        r = 1 << log2r
        rows_out = cdiv(n, r)
        y = torch.empty((rows_out, m), dtype=x.dtype, device=x.device)
        col_blocks = cdiv(m, c)
        _tree_rows_kernel_fast[(rows_out * col_blocks,)](x, y, n, m, col_blocks, C=c, R=r, LOG2R=log2r,
                                                         num_warps=NUM_WARPS)
        x, n = y, rows_out
    return x[0]

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_tree_rows_kernel_fast = fast(_tree_rows_kernel)

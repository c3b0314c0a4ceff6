"""rlkernel.tree_sum on the GPU: the balanced binary tree of adjacent pairs, in as few launches
as the length needs (two for a million summands), bit for bit the torch composition.

Why: the composition in `reference.primitives.tree_sum` costs two launches per tree level plus
a padding fill; a strict GRPO update of a 28-layer model ran about 15,000 of them (the global
grad norm sums every parameter by the tree, RMSNorm's weight gradient sums over tokens), which
made the update launch-bound on an H200 (`benchmarks/h200_update_profile.json`).

The order is the contract's, unchanged: the length n padded with +0.0 to P = next power of two,
then a[0::2] + a[1::2] until one is left. A program loads an aligned block of R = 2^b rows
(R <= P; rows past n read +0.0, exactly the padding) and folds it by the same adjacent pairs in
registers (a reshape to [.., R/2, 2] and a split), so it writes the block's subtree sum. The
next launch folds those sums the same way: ceil(n/R) padded to its next power of two is P/R,
so the two trees are the same tree. Each add is one IEEE float32 add of the same two operands
as the composition's, hence the same bits (tests under TRITON_INTERPRET=1 compare them with
torch.equal; `scripts/gpu_strict_parity.py` on the GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from .launch import fast, cdiv

MAX_LOG2_ROWS = 12  # rows folded per program (R <= 4096): a million summands take two launches


@triton.jit
def _fold(x, C: tl.constexpr, HALF: tl.constexpr):
    """[C, 2*HALF] -> [C, HALF]: column j is x[:, 2j] + x[:, 2j+1]."""
    a, b = tl.split(tl.reshape(x, (C, HALF, 2)))
    return a + b


@triton.jit(do_not_specialize=["n", "m", "col_blocks"])  # few compiled variants: the shapes vary every step
def _tree_rows_kernel(x_ptr, y_ptr, n, m, col_blocks, C: tl.constexpr, R: tl.constexpr, LOG2R: tl.constexpr):
    """x [n, m] row-major float32 -> y [ceil(n/R), m]: y[i, c] = the tree over x[i*R:(i+1)*R, c]. One grid axis (a
    second one is capped at 65,535 programs: an 8B model's embedding alone has 152k blocks of rows)."""
    pid = tl.program_id(0).to(tl.int64)
    pid_r = pid // col_blocks
    pid_c = pid % col_blocks
    rows = pid_r * R + tl.arange(0, R)
    cols = pid_c * C + tl.arange(0, C)
    mask = (cols[:, None] < m) & (rows[None, :] < n)
    x = tl.load(x_ptr + rows[None, :] * m + cols[:, None], mask=mask, other=0.0)  # [C, R], padding +0.0
    if LOG2R > 0:
        x = _fold(x, C, R >> 1)
    if LOG2R > 1:
        x = _fold(x, C, R >> 2)
    if LOG2R > 2:
        x = _fold(x, C, R >> 3)
    if LOG2R > 3:
        x = _fold(x, C, R >> 4)
    if LOG2R > 4:
        x = _fold(x, C, R >> 5)
    if LOG2R > 5:
        x = _fold(x, C, R >> 6)
    if LOG2R > 6:
        x = _fold(x, C, R >> 7)
    if LOG2R > 7:
        x = _fold(x, C, R >> 8)
    if LOG2R > 8:
        x = _fold(x, C, R >> 9)
    if LOG2R > 9:
        x = _fold(x, C, R >> 10)
    if LOG2R > 10:
        x = _fold(x, C, R >> 11)
    if LOG2R > 11:
        x = _fold(x, C, R >> 12)
    out = tl.reshape(x, (C,))
    tl.store(y_ptr + pid_r * m + cols, out, mask=cols < m)


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
        _tree_rows_kernel_fast[(rows_out * col_blocks,)](x, y, n, m, col_blocks, C=c, R=r, LOG2R=log2r, num_warps=4)
        x, n = y, rows_out
    return x[0]

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_tree_rows_kernel_fast = fast(_tree_rows_kernel)

"""GEMM: `linear(x, weight, bias)` mirroring F.linear, reduction over K.

Strict contract: rows are cut into zero-padded tiles of TILE_ROWS, each tile one
problem of a batched fp32 GEMM, so a row never sees how many rows share the call
(the native M=1 GEMV vs M>=8 GEMM switch is what breaks batch invariance on
CPUs, and M>=64 kernel switches on GPUs). K may be cut into `k_segments`
canonical segments whose partials are merged by one balanced tree: the layout a
row-parallel TP layer reproduces rank by rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch, fused
from ..contract import Contract
from ..primitives import CUDA_BLOCK_ROWS, TILE_ROWS, tile_matmul, tree_sum

# Narrow weights are zero-padded to this many output columns (see _linear_reference).
MIN_COLS = 16

REFERENCE = Contract(
    op="linear",
    backend="reference",
    domain="K",
    partition=(("m_tile", f"{TILE_ROWS} rows per batched-GEMM problem on CPU; {CUDA_BLOCK_ROWS}-row plain GEMMs on CUDA"),
               ("n", f"whole weight, >= {16} columns"), ("split_k", 1), ("k_segments", "caller, equal, default 1")),
    merge="BLAS order inside one fixed [16,K/s]x[K/s,N] fp32 tile; segment partials by balanced binary tree",
    precision=(("input", "x.dtype"), ("accumulate", "float32"), ("partials", "float32"), ("output", "x.dtype")),
    rounding=("operands widened to float32 exactly", "bias added in float32", "one cast to x.dtype at the end"),
    invariant=("batch", "row position", "column slice (fused vs split weights, TP column shards)", "threads 1 vs 2", "run to run"),
)
NATIVE = Contract(
    op="linear",
    backend="native",
    domain="K",
    partition=(("m_tile", "library heuristic"),),
    merge="library heuristic (GEMV for small M, GEMM otherwise)",
    precision=(("input", "x.dtype"), ("accumulate", "library"), ("output", "x.dtype")),
    rounding=("library",),
)


def _widen(weight):
    """float32 weight, zero-padded to MIN_COLS rows: BLAS takes another kernel for very narrow
    outputs (measured: N <= 8 in fp32), so a column's bits would depend on its neighbours."""
    w = weight.float()
    n = w.shape[0]
    return torch.nn.functional.pad(w, (0, 0, 0, MIN_COLS - n)) if n < MIN_COLS else w


def _partials(x2, w, k_segments):
    k = x2.shape[-1]
    if k_segments < 1 or k % k_segments:
        raise ValueError(f"linear: K={k} is not divisible into {k_segments} canonical segments")
    seg = k // k_segments
    return [tile_matmul(x2[:, i * seg:(i + 1) * seg], w[:, i * seg:(i + 1) * seg].t()) for i in range(k_segments)]


def canonical_segments(k: int, max_segments: int) -> int:
    """The canonical K-segment count of a row-parallel GEMM: the largest power of two
    <= max_segments that divides K. Both engines must derive it from the same (K, max)."""
    s = 1
    while s * 2 <= max_segments and k % (s * 2) == 0:
        s *= 2
    return s


def linear_segment_partials(x: torch.Tensor, weight: torch.Tensor, k_segments: int) -> list[torch.Tensor]:
    """float32 partial products of `k_segments` equal K-slices: [M, N] each, x flattened to [M, K].

    A row-parallel TP rank holding K-columns [r*K/tp, (r+1)*K/tp) of the weight calls this with
    k_segments = S/tp; merging every rank's partials with `rlkernel.tree_all_reduce` then equals
    `linear(x, full_weight, k_segments=S)` bit for bit (before the final cast).
    """
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"linear: x has K={x.shape[-1]} but weight is {tuple(weight.shape)}")
    dispatch.note_call("linear", "reference", (x, weight))
    n = weight.shape[0]
    w = _widen(weight)
    return [p[:, :n] for p in _partials(x.reshape(-1, x.shape[-1]).float(), w, k_segments)]


class _FusedLinear(torch.autograd.Function):
    """Training forward through the fused kernel (the reference bits); backward by tile GEMMs
    (dx = g W, dW = g^T x) and a tree over rows for the bias: deterministic, thread-independent."""

    @staticmethod
    def forward(ctx, x, weight, bias, k_segments, plain):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return fused.ops().linear(x, weight, bias, k_segments, plain)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g32 = g.reshape(-1, w.shape[0]).float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = tile_matmul(g32, w.float()).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gw = tile_matmul(g32.t(), x.reshape(-1, x.shape[-1]).float()).to(w.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            gb = tree_sum(g32, dim=0).to(ctx.bias_dtype)
        return gx, gw, gb, None, None


@dispatch.register("linear", "reference", REFERENCE)
def _linear_reference(x, weight, bias=None, k_segments: int = 1):
    k = x.shape[-1]
    if weight.shape[-1] != k:
        raise ValueError(f"linear: x has K={k} but weight is {tuple(weight.shape)}")
    path = fused.route(x, weight, bias) if k_segments >= 1 and k % k_segments == 0 else None
    if path is not None:
        plain = fused.plain_gemm_ok(k // k_segments, max(weight.shape[0], MIN_COLS))
        if path == "kernel":
            return fused.ops().linear(x, weight, bias, k_segments, plain)
        return _FusedLinear.apply(x, weight, bias, k_segments, plain)
    lead, n = x.shape[:-1], weight.shape[0]
    x2 = x.reshape(-1, k).float()
    w = _widen(weight)
    if k_segments == 1:
        out = tile_matmul(x2, w.t())
    else:
        out = tree_sum(torch.stack(_partials(x2, w, k_segments), dim=-1), dim=-1)
    out = out[:, :n]  # drop the zero columns of a narrow weight (see _widen) before the bias
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, n)


@dispatch.register("linear", "native", NATIVE)
def _linear_native(x, weight, bias=None, k_segments: int = 1):
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, k_segments: int = 1, backend: str | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias), like F.linear; x [..., K], weight [N, K]."""
    return dispatch.call("linear", backend, (x, weight), x, weight, bias, k_segments=k_segments)

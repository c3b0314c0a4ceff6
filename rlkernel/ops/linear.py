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

from .. import dispatch
from ..contract import Contract
from ..primitives import TILE_ROWS, tile_matmul, tree_sum

# Narrow weights are zero-padded to this many output columns (see _linear_reference).
MIN_COLS = 16

REFERENCE = Contract(
    op="linear",
    backend="reference",
    domain="K",
    partition=(("m_tile", TILE_ROWS), ("n", f"whole weight, >= {16} columns"), ("split_k", 1), ("k_segments", "caller, equal, default 1")),
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


@dispatch.register("linear", "reference", REFERENCE)
def _linear_reference(x, weight, bias=None, k_segments: int = 1):
    k = x.shape[-1]
    if weight.shape[-1] != k:
        raise ValueError(f"linear: x has K={k} but weight is {tuple(weight.shape)}")
    lead, n = x.shape[:-1], weight.shape[0]
    x2 = x.reshape(-1, k).float()
    w = weight.float()
    if n < MIN_COLS:
        # BLAS takes another kernel for very narrow outputs (measured: N <= 8 in fp32),
        # so a column's bits would depend on how many columns share the weight.
        w = torch.nn.functional.pad(w, (0, 0, 0, MIN_COLS - n))
    if k_segments == 1:
        out = tile_matmul(x2, w.t())
    else:
        if k % k_segments:
            raise ValueError(f"linear: K={k} is not divisible into {k_segments} canonical segments")
        seg = k // k_segments
        parts = [tile_matmul(x2[:, i * seg:(i + 1) * seg], w[:, i * seg:(i + 1) * seg].t()) for i in range(k_segments)]
        out = tree_sum(torch.stack(parts, dim=-1), dim=-1)
    if bias is not None:
        out = out + bias.float()
    return out[:, :n].to(x.dtype).reshape(*lead, n)


@dispatch.register("linear", "native", NATIVE)
def _linear_native(x, weight, bias=None, k_segments: int = 1):
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, k_segments: int = 1, backend: str | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias), like F.linear; x [..., K], weight [N, K]."""
    return dispatch.call("linear", backend, (x, weight), x, weight, bias, k_segments=k_segments)

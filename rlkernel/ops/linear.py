"""`linear(x, weight, bias)`: mirrors F.linear (contract: rlkernel/contracts/gemm.py)."""
from __future__ import annotations

import numbers

import torch

from .. import dispatch
from ._dtypes import data_dtype
from ..backends.reference import linear as _ref


def canonical_segments(k: int, max_segments: int) -> int:
    """The canonical K-segment count of a row-parallel GEMM: the largest power of two
    <= max_segments that divides K. Both engines must derive it from the same (K, max)."""
    s = 1
    while s * 2 <= max_segments and k % (s * 2) == 0:
        s *= 2
    return s


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, k_segments: int = 1, backend: str | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias), like F.linear; x [..., K], weight [N, K]. `k_segments` cuts K
    into canonical segments merged by one tree (the layout a row-parallel TP layer reproduces)."""
    if x.dim() == 0 or weight.dim() != 2 or weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"linear: want x [..., K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    data_dtype("linear", x=x, weight=weight, bias=bias)
    if bias is not None and (bias.shape != weight.shape[:1] or bias.device != weight.device):
        raise ValueError(f"linear: bias {tuple(bias.shape)} on {bias.device} does not match {weight.shape[0]} outputs on "
                         f"{weight.device}")
    if not isinstance(k_segments, numbers.Integral) or isinstance(k_segments, bool):
        raise ValueError(f"linear: k_segments must be an int, got {k_segments!r}")
    if k_segments < 1 or x.shape[-1] % k_segments:
        raise ValueError(f"linear: K={x.shape[-1]} is not divisible into {k_segments} canonical segments")
    return dispatch.call("linear", backend, (x, weight), x, weight, bias, k_segments=k_segments)


def linear_segment_partials(x: torch.Tensor, weight: torch.Tensor, k_segments: int) -> list[torch.Tensor]:
    """float32 partial products of `k_segments` equal K-slices: [M, N] each, x flattened to [M, K].

    A row-parallel TP rank holding K-columns [r*K/tp, (r+1)*K/tp) of the weight calls this with
    k_segments = S/tp; merging every rank's partials with `rlkernel.tree_all_reduce` then equals
    `linear(x, full_weight, k_segments=S)` bit for bit (before the final cast). Differentiable.
    """
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"linear: x has K={x.shape[-1]} but weight is {tuple(weight.shape)}")
    data_dtype("linear_segment_partials", x=x, weight=weight)
    impl = dispatch.resolve("linear", x.device, "strict")
    dispatch.note_call("linear", impl, (x, weight))
    return _ref.partials(x, weight, k_segments, prims=impl.prims)

"""The public ops' floating-point dtypes: what the contracts define, checked before dispatch (metadata only, no sync).

The contracts are written for float32, bfloat16 and float16 data, and for one dtype per op's data tensors (a mixed
call had a meaning on some backends and none on others: the CPU GEMM widened both operands, the Triton GEMM refused,
the Triton logprob and attention kernels would have fed two dtypes to one dot). float64 is refused: every strict
backend computes in float32, so a float64 input would be rounded without a word. The one declared mix is rms_norm's
weight (contracts/norm.py: the output is in the weight's dtype)."""
from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def data_dtype(op: str, **tensors) -> None:
    """`op`'s named data tensors (None: absent) are of one dtype, one of `DTYPES`."""
    named = {k: t for k, t in tensors.items() if t is not None}
    for name, t in named.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"{op}: {name} is {t.dtype}; the contracts define float32, bfloat16 and float16 "
                             "(every strict backend computes in float32: float64 would be rounded to it)")
    if len({t.dtype for t in named.values()}) > 1:
        got = ", ".join(f"{k} {t.dtype}" for k, t in named.items())
        raise ValueError(f"{op}: {' and '.join(named)} must share one dtype (the contract defines no mixed arithmetic); "
                         f"got {got}: cast them to one")

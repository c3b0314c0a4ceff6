"""rlkernel's numerical contracts, as data: the one source of every order and constant.

What this package decides: for each op, which values are reduced, partitioned how, merged
in which order (down to the K walk of every GEMM output), at which precision, rounded
where, with which primitives. Implementations (`rlkernel/backends/`) take their constants
from here — the C++ kernels assert equality at load — and claim a contract; two
implementations of one contract must give the same bits, which the tests and the golden
suite check. `diff` compares two contracts field by field (ΔC) before anything runs.
"""
from . import attention, collectives, gemm, logprob, norm, primitives, rope, swiglu
from .base import Contract, FieldDiff, diff

__all__ = ["Contract", "FieldDiff", "diff", "attention", "collectives", "gemm", "logprob", "norm", "primitives", "rope", "swiglu"]

# op name (as in rlkernel's public API) -> its contract module (STRICT, NATIVE)
BY_OP = {"linear": gemm, "rms_norm": norm, "swiglu": swiglu, "rope": rope, "attention": attention, "linear_logprob": logprob}

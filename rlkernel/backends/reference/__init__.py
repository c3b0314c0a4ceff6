"""The reference implementation of the strict contracts: a torch composition (the spec).

Registered for every op on every device; `rlkernel.mode(impl="reference")` pins it.
"""
from ... import dispatch
from ...contracts import attention as c_attention
from ...contracts import gemm as c_gemm
from ...contracts import logprob as c_logprob
from ...contracts import norm as c_norm
from ...contracts import rope as c_rope
from ...contracts import swiglu as c_swiglu
from . import attention, linear, logprob, norm, rope, swiglu
from .primitives import REFERENCE


def _register(op, contract, fn):
    dispatch.register(op, "reference", contract, prims=REFERENCE)(fn)


_register("linear", c_gemm.STRICT, linear.linear)
_register("rms_norm", c_norm.STRICT, norm.rms_norm)
_register("swiglu", c_swiglu.STRICT, swiglu.swiglu)
_register("rope", c_rope.STRICT, rope.rope)
_register("attention", c_attention.STRICT, attention.attention)
_register("linear_logprob", c_logprob.STRICT, logprob.linear_logprob)

"""SwiGLU activation: silu(gate) * up, element-wise.

gate and up arrive materialised in the activation dtype (the outputs of the gate/up GEMM are
rounded there: the materialisation boundary); SiLU is x / (1 + exp(-x)) in fp32 with the
position-independent exp; the product is fp32; one rounding to the activation dtype.
"""
from .base import Contract
from .primitives import EXP, SILU

STRICT = Contract(
    op="swiglu",
    backend="strict",
    domain="none (element-wise)",
    partition=(("gate_up", "materialised in activation dtype before SiLU"),),
    merge="none",
    precision=(("input", "act dtype"), ("compute", "float32"), ("output", "act dtype")),
    rounding=("gate/up rounded to act dtype by the GEMM", "one cast after silu(gate)*up in fp32"),
    primitives=(SILU, EXP),
    invariant=("batch", "row position", "threads", "ISA", "run to run"),
)
NATIVE = Contract(
    op="swiglu",
    backend="native",
    domain="none (element-wise)",
    partition=(("gate_up", "materialised in activation dtype before SiLU"),),
    merge="none",
    precision=(("input", "act dtype"), ("compute", "library"), ("output", "act dtype")),
    rounding=("silu rounded to act dtype", "product rounded to act dtype"),
    primitives=(("silu", "torch vectorised silu (Sleef) / scalar tail"),),
)

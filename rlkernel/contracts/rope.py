"""Rotary position embedding (NeoX/HF `rotate_half` layout).

One cos/sin table per (head_dim, theta), built on the host in fixed blocks of ROPE_BLOCK
positions: inv_freq = theta**(-2i/d) correctly rounded to float64, angle = position * inv_freq
(one float64 multiply), entry = cos/sin(angle) correctly rounded to float32 (libm's float64
value, with the rare entries near a float32 rounding midpoint recomputed exactly). So an entry
depends on neither the table length, the device, the libm nor the ISA. Rotation in fp32, one
cast to the activation dtype.
"""
from .base import Contract

ROPE_BLOCK = 256

STRICT = Contract(
    op="rope",
    backend="strict",
    domain="none (element-wise)",
    partition=(("table_block", ROPE_BLOCK), ("layout", "rotate_half")),
    merge="none",
    precision=(("table", "float64 -> float32 once"), ("compute", "float32"), ("output", "x.dtype")),
    rounding=("x widened to fp32", "x1*cos - x2*sin, x2*cos + x1*sin in fp32 (products rounded, no fma)", "one cast to x.dtype"),
    primitives=(("inv_freq", "theta**(-2i/d) correctly rounded to float64"), ("angle", "position * inv_freq, float64"),
                ("cos/sin", "correctly rounded to float32, fixed blocks")),
    invariant=("batch", "prefill/decode (by position)", "table length", "device", "threads", "ISA", "libm"),
    version=2,  # v1: torch float64 pow/cos/sin rounded to float32 (last bits could follow the ISA)
)
NATIVE = Contract(
    op="rope",
    backend="native",
    domain="none (element-wise)",
    partition=(("table", "whole length, library"), ("layout", "rotate_half")),
    merge="none",
    precision=(("table", "float32 -> x.dtype"), ("compute", "x.dtype"), ("output", "x.dtype")),
    rounding=("cos/sin cast to x.dtype", "x*cos + rotate_half(x)*sin in x.dtype"),
    primitives=(("cos/sin", "float32 torch over the whole table"),),
)

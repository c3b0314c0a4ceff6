"""Rotary position embedding (NeoX/HF `rotate_half` layout).

One cos/sin table per (head_dim, theta), computed on the host in float64 in fixed blocks of
ROPE_BLOCK positions and rounded once to float32, so an entry never depends on how many
positions were asked for nor on the device. Rotation in fp32, one cast to the activation dtype.
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
    primitives=(("inv_freq", "1/theta**(2i/d), float64 on host"), ("cos/sin", "float64 torch on host, fixed blocks")),
    invariant=("batch", "prefill/decode (by position)", "table length", "device", "threads", "ISA"),
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

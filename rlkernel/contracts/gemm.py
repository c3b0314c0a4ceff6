"""GEMM (`linear`, and every GEMM inside another strict op): reduction over K.

The strict order is ours, not a BLAS's: every output element is one float32 fused
multiply-add chain over K in ascending order, starting from +0.0:

    acc = 0; for k in 0 .. K-1: acc = fma(a[m, k], b[k, n], acc)

Operands are widened to float32 exactly first. Nothing else decides the bits: no K split
(no split-K, no K blocks summed apart, no dot-product instructions), SIMD runs across output
columns and threads across M/N blocks, so the vector width, the thread count and the number
of rows in the call cannot change a value (an MKL or oneDNN GEMM changes its internal K order
with all three: measured on an AVX-512 + AMX CPU). A row-parallel layer may cut K into
`k_segments` canonical equal segments; each is its own chain and the partials are merged by
one balanced binary tree (the layout a TP group reproduces rank by rank). The backward GEMMs
(dx = g W, dW = g^T x) follow the same rule, with K = N and K = M (tokens, ascending) resp.
"""
from .base import Contract
from .primitives import FMA

K_ORDER = "per output: one float32 fma chain over K ascending from +0.0 (acc = fma(a[m,k], b[k,n], acc))"

STRICT = Contract(
    op="linear",
    backend="strict",
    domain="K",
    partition=(("m", "every row alone (no tiles)"), ("n", "every column alone"), ("split_k", 1),
               ("k_segments", "caller, equal, default 1; each segment its own chain")),
    merge=K_ORDER + "; segment partials by balanced binary tree (zero-padded to a power of two)",
    precision=(("input", "x.dtype"), ("accumulate", "float32"), ("partials", "float32"), ("output", "x.dtype")),
    rounding=("operands widened to float32 exactly", "every fma rounds once", "bias added in float32", "one cast to x.dtype at the end"),
    primitives=(FMA,),
    invariant=("batch", "row position", "column slice (fused vs split weights, TP column shards)", "threads", "ISA", "run to run"),
    version=3,  # v2 and before: the BLAS's order inside fixed 16-row tiles (which MKL changes with threads and ISA)
)
NATIVE = Contract(
    op="linear",
    backend="native",
    domain="K",
    partition=(("m_tile", "library heuristic"),),
    merge="library heuristic (GEMV for small M, GEMM otherwise; K order by ISA and threads)",
    precision=(("input", "x.dtype"), ("accumulate", "library"), ("output", "x.dtype")),
    rounding=("library",),
)

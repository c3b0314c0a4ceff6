"""Causal GQA attention: packed variable-length prefill and paged-KV queries.

Keys are cut into chunks of ATTN_CHUNK by *absolute key position* (a fixed split size, never
a fixed number of splits). Per query and chunk: s_j = (q . k_j) as one fp32 fma chain over the
head dim ascending (the GEMM contract), times the scale, masked past the query's position;
m' = max(m, max_j s_j), alpha = exp(m - m'), p_j = exp(s_j - m'), l = l * alpha + tree(p),
o_d = o_d * alpha + (p . v)_d with (p . v)_d one fp32 fma chain over the chunk's keys
ascending; chunks merged left to right; out = o / l, one cast. A query's value therefore
depends only on its own q, its position and the keys it sees: packed prefill, token-by-token
decode against a paged cache and chunked prefill at any boundary give the same bits. Chunks
past a query's position are exact identities (alpha = 1, p = 0).
"""
from .base import Contract
from .gemm import K_ORDER
from .primitives import EXP, FMA

ATTN_CHUNK = 32

STRICT = Contract(
    op="attention",
    backend="strict",
    domain="visible keys",
    partition=(("kv_chunk", ATTN_CHUNK), ("chunk_anchor", "absolute key position"), ("q", "every query row alone")),
    merge=("online softmax (m, l, o) over kv chunks, left to right; within a chunk: l by balanced tree; "
           "q.k and p.v: " + K_ORDER),
    precision=(("q,k,v", "widened to float32"), ("scores", "float32"), ("m,l,o", "float32"), ("output", "q.dtype")),
    rounding=("scores = (q.k) * scale", "p = exp(s - m)", "o * alpha + p.v", "o / l then one cast to q.dtype"),
    primitives=(EXP, FMA, ("max", "exact")),
    invariant=("batch", "prefill == decode == chunked prefill", "block size/placement", "threads", "ISA", "run to run"),
    version=3,  # v2 and before: q.k and p.v as BLAS tile GEMMs
)
NATIVE = Contract(
    op="attention",
    backend="native",
    domain="visible keys",
    partition=(("kv_split", "library (SDPA; packed causal on CUDA in half precision: torch varlen flash attention)"),),
    merge="torch scaled_dot_product_attention, or torch.nn.attention.varlen.varlen_attn",
    precision=(("q,k,v", "input dtype"), ("output", "q.dtype")),
    rounding=("library",),
    primitives=(("exp", "library"),),
)

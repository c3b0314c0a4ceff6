"""Collectives: reductions over ranks whose bits do not depend on the world size.

The strict path reduces over *canonical segments*, not ranks: the payload is cut into S
segments (S fixed by the model, not by the world size); rank r owns the contiguous block
r*k .. r*k+k-1; segments travel unchanged (all_gather, rank order) and every rank sums all S
with one balanced binary tree over segment index, accumulating in float32, rounding once.
The vocab-parallel logprob is the linear-logprob contract with vocab tiles as the segments.
"""
import dataclasses

from . import logprob
from .base import Contract

ALL_REDUCE_REFERENCE = Contract(
    op="all_reduce",
    backend="strict",
    domain="ranks, as S canonical segments",
    partition=(("segments", "S = world_size * k, fixed by the caller"), ("ownership", "rank r owns segments [r*k, r*k + k)"), ("transport", "all_gather, rank order: where k is a power of two >= 2 the rank's float32 subtree sum (its block "
                                                 "is a subtree of the canonical tree: the same adds), else its k segments")),
    merge="balanced binary tree over canonical segment index (zero-padded to a power of two), run identically on every rank",
    precision=(("payload", "segment dtype, sent unchanged (or the float32 subtree sum)"), ("accumulate", "float32 (float64 stays float64)"), ("output", "payload dtype")),
    rounding=("one cast of the tree sum to the payload dtype",),
    primitives=(("add", "IEEE element-wise"),),
    invariant=("world size", "rank", "run to run"),
)
ALL_REDUCE_NATIVE = Contract(
    op="all_reduce",
    backend="native",
    domain="ranks",
    partition=(("segments", "one partial sum per rank"), ("ownership", "rank r owns segments [r*k, r*k + k)"), ("transport", "dist.all_reduce (backend algorithm)")),
    merge="left-to-right sum of the rank's own segments, then the backend's reduction order (depends on world size, algorithm, chunk)",
    precision=(("payload", "segment dtype"), ("accumulate", "payload dtype"), ("output", "payload dtype")),
    rounding=("every add rounds to the payload dtype",),
    primitives=(("add", "IEEE element-wise"),),
)
ALL_GATHER_REFERENCE = Contract(
    op="all_gather",
    backend="strict",
    domain="ranks",
    partition=(("ownership", "rank r owns block r"),),
    merge="concatenation in rank order (no arithmetic)",
    precision=(("payload", "input dtype, unchanged"),),
    invariant=("rank", "run to run"),
)
# Numerically the single-process linear-logprob contract: only the op name and the
# claimed invariance differ, which is the point (diff against it with op renamed is empty).
VOCAB_PARALLEL_LOGPROB_REFERENCE = dataclasses.replace(
    logprob.STRICT,
    op="vocab_parallel_logprob",
    invariant=logprob.STRICT.invariant + ("tensor-parallel world size (shard boundaries multiples of VOCAB_TILE)",),
)
# The backward of a tensor-parallel layer stack, made independent of the TP size: every gradient
# that TP splits into per-rank partial sums is cut into S canonical segments (S from the model,
# not the world) and merged by ALL_REDUCE_REFERENCE's tree. rlkernel/parallel/tp_backward.py.
TP_BACKWARD_REFERENCE = Contract(
    op="tp_backward",
    backend="strict",
    domain="gradients of column-parallel inputs, vocab-parallel logprob inputs, per-head norm weights, the global grad norm",
    partition=(
        ("column-parallel dX", "S = canonical_segments(N / stride, row_segments) segments of the output rows (a segment = the rows "
                               "rank s would hold at TP = S, stride chunks included); partial dY_s @ W_s per segment, float32"),
        ("vocab-parallel dhidden", "S_v = row_segments segments of ceil(tiles / S_v) VOCAB_TILEs each; tiles left to right inside a "
                                   "segment (each tile's share a contract GEMM)"),
        ("vocab-parallel operands", "dz = (onehot - p) * g / T in float32, rounded once to the lm_head's dtype; the hidden in that "
                                    "dtype; both backward GEMMs (dW = dz^T h, each tile's dz W) take them, float32 accumulate"),
        ("per-head norm weights", "S_h = canonical_segments(heads, row_segments) head segments; each segment's weight grad from the "
                                  "rms_norm backward of its rows"),
        ("grad norm", "per parameter: its S canonical segments (rows / columns as above), each a tree sum of squares; replicated "
                      "parameters one segment; then a tree over parameters in named order"),
    ),
    merge="ALL_REDUCE_REFERENCE's tree over all S segments (every rank, every TP size dividing S)",
    precision=(("partials", "float32"), ("output", "the parameter / activation dtype, one cast")),
    rounding=("one cast after the tree",),
    primitives=(("add", "IEEE element-wise"), ("gemm", "the strict linear contract")),
    invariant=("tensor-parallel world size dividing S", "rank", "run to run"),
)
# The backward's sums over tokens, made independent of the context-parallel size: the packed stream (padded to a
# multiple of S) cut into S canonical token segments (S = trainer.token_segments, a power of two; CP rank r holds
# segments [r*S/CP, (r+1)*S/CP)). rlkernel/parallel/token_segments.py.
TOKEN_SEGMENTS_BACKWARD = Contract(
    op="token_segments_backward",
    backend="strict",
    domain="sums over tokens in the backward: weight gradients (linears, norms, embedding rows, lm head) and the key/value "
           "gradients of attention (sums over the queries that see them)",
    partition=(
        ("segments", "S equal, contiguous slices of the padded stream; each computed alone (its tokens' GEMM, its rows' "
                     "tree, its queries' attention backward by pieces, its ids' index_put accumulation)"),
        ("ownership", "CP rank r: segments [r*S/CP, (r+1)*S/CP)"),
        ("ties", "a weight used twice (embedding tied to the lm head): both uses' float32 partials added per segment, "
                 "in backward order, before any tree"),
    ),
    merge="the balanced binary tree over the rank's segments, then ALL_REDUCE_REFERENCE's tree over the CP ranks (an aligned "
          "subtree: the tree over all S segments)",
    precision=(("partials", "float32"), ("output", "the parameter / key-value dtype, one cast after the trees")),
    rounding=("one cast after the tree",),
    primitives=(("add", "IEEE element-wise"), ("gemm", "the strict linear contract")),
    invariant=("context-parallel size dividing S", "rank", "run to run"),
)

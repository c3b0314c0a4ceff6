"""Linear-logprob: hidden x lm_head -> float32 logprob of chosen tokens.

The true vocab [0, vocab_size) is cut into tiles of VOCAB_TILE rows of the lm_head (padding
rows are never read); each tile's logits follow the GEMM contract (one fp32 fma chain over
the hidden dim per logit), divided by the temperature, reduced to a per-tile (m, l) with l a
balanced tree of position-independent exps; the tiles' (m, l) are merged by one balanced
binary tree over tile index (identity-padded to a power of two — the same tree a
vocab-parallel group reproduces, rank blocks being its subtrees); logprob = (z_t - m) - log(l).
"""
from .base import Contract
from .gemm import K_ORDER
from .primitives import EXP, FMA, LOG

VOCAB_TILE = 512

STRICT = Contract(
    op="linear_logprob",
    backend="strict",
    domain="vocab [0, vocab_size)",
    partition=(("vocab_tile", VOCAB_TILE), ("padding_rows", "excluded"), ("rows", "every token alone")),
    merge=("logits: " + K_ORDER + "; per tile: m = max, l = balanced tree of exp(z - m); "
           "across tiles: balanced binary tree over tile index"),
    precision=(("hidden,weight", "widened to float32"), ("logits", "float32"), ("m,l", "float32"), ("output", "float32")),
    rounding=("z = (h.w) / temperature", "lp = (z_t - m) - log(l)"),
    primitives=(EXP, LOG, FMA),
    invariant=("batch", "row position", "threads", "ISA", "run to run"),
    version=3,  # v2 and before: tile logits as BLAS tile GEMMs
)
NATIVE = Contract(
    op="linear_logprob",
    backend="native",
    domain="vocab [0, vocab_size)",
    partition=(("vocab_tile", "whole vocab"),),
    merge="torch log_softmax over full float32 logits",
    precision=(("logits", "hidden dtype, then float32"), ("output", "float32")),
    rounding=("logits rounded to hidden dtype by F.linear", "logits.float() / temperature"),
    primitives=(("exp/log", "library"),),
)

"""Reductions over ranks: canonical-segment collectives and the vocab-parallel logprob."""
from .collectives import all_gather, canonical_tree_sum, native_all_reduce, tree_all_reduce, vocab_parallel_entropy, vocab_parallel_logprob
from .vocab_parallel import vocab_parallel_logprob_fn

__all__ = ["all_gather", "canonical_tree_sum", "native_all_reduce", "tree_all_reduce", "vocab_parallel_entropy", "vocab_parallel_logprob", "vocab_parallel_logprob_fn"]

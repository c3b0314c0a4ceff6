"""rlkernel: strict ops whose numerics are a declared contract.

The public API is flat. With no mode set every op runs its strict contract on the best
implementation for the device (`cpu` kernels on the CPU when built, else the `reference`
composition: the same bits); `rlkernel.mode("native")` runs the production ops instead,
for ablations and negative controls. Layout: `contracts/` (the orders and constants, as
data), `backends/` (reference, cpu, native, triton), `ops/` (the public functions),
`parallel/` (collectives), `models/` and `integrations/` (vLLM, Megatron).
"""
from .contracts import Contract, FieldDiff, diff
from .contracts.attention import ATTN_CHUNK
from .contracts.logprob import VOCAB_TILE
from .dispatch import (OPS, BackendUnavailable, ExecutionPolicy, ProvenanceCounter, ProvenanceRecord, contract_for, contracts_match,
                       current_policy, mode, record_provenance)
from .ops.attention import attention_paged, attention_varlen, write_kv_cache
from .ops.linear import linear
from .ops.logprob import linear_entropy, linear_logprob, linear_logprobs_full
from .ops.norm import rms_norm, rms_norm_rope
from .ops.rope import rope, rope_table
from .ops.swiglu import linear_swiglu, swiglu
from .backends.reference.primitives import tree_sum
from .parallel import all_gather, canonical_tree_sum, native_all_reduce, tree_all_reduce, vocab_parallel_entropy, vocab_parallel_logprob

__all__ = [
    "OPS",
    "ATTN_CHUNK",
    "VOCAB_TILE",
    "BackendUnavailable",
    "Contract",
    "ExecutionPolicy",
    "FieldDiff",
    "ProvenanceCounter",
    "ProvenanceRecord",
    "contracts_match",
    "all_gather",
    "attention_paged",
    "canonical_tree_sum",
    "native_all_reduce",
    "tree_all_reduce",
    "vocab_parallel_logprob",
    "vocab_parallel_entropy",
    "attention_varlen",
    "contract_for",
    "current_policy",
    "diff",
    "linear",
    "linear_entropy",
    "linear_logprob",
    "linear_logprobs_full",
    "linear_swiglu",
    "mode",
    "record_provenance",
    "rms_norm",
    "rms_norm_rope",
    "rope",
    "rope_table",
    "swiglu",
    "tree_sum",
    "write_kv_cache",
]

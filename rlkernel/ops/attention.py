"""Causal GQA attention: packed varlen prefill, paged-KV queries, the KV write
(contract: rlkernel/contracts/attention.py)."""
from __future__ import annotations

import torch

from .. import dispatch
from ..backends import cpu as _cpu
from ..backends.triton import ops as _triton


def _check(q, k, v):
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"attention: want q [T, Hq, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads cannot share {k.shape[1]} kv heads of dim {k.shape[-1]}")


def attention_varlen(q, k, v, cu_seqlens, *, scale: float | None = None, backend: str | None = None,
                     max_seqlen: int | None = None) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1] (int).

    max_seqlen: a bound >= the longest sequence, when the host has it (Megatron's PackedSeqParams does); a GPU
    implementation then launches without reading it back (no device sync; a device-side assert checks it). It sizes
    the launch only, never a value."""
    _check(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    hints = {} if max_seqlen is None else {"max_query_len": int(max_seqlen)}
    return dispatch.call("attention", backend, (q, k, v), "varlen", q, k, v, cu_seqlens, scale, **hints)


def attention_paged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale: float | None = None, backend: str | None = None,
                    max_query_len: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Queries against a paged KV cache (decode and chunked prefill).

    q [Tq, Hq, D]: request b owns rows query_start_loc[b]:query_start_loc[b+1], which are the
    *last* tokens of its sequence of seq_lens[b] tokens (their keys must already be in the cache).
    k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] (int).
    max_query_len / max_seq_len: the host's bounds when it has them (an engine's scheduler
    does); a GPU implementation then launches without reading them back (no device sync).
    They size the launch only, never a value.
    """
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"attention_paged: want caches [blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    _check(q, k_cache[0], v_cache[0])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    hints = {k: int(v) for k, v in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)) if v is not None}
    return dispatch.call("attention", backend, (q, k_cache, v_cache), "paged", q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                         **hints)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Copy k/v [T, Hkv, D] into the caches at flat slots (block * block_size + offset); exact copies.
    Negative slots (vLLM's padding, PAD_SLOT_ID = -1) are skipped."""
    if _cpu.write_kv(k, v, k_cache, v_cache, slot_mapping) or _triton.write_kv(k, v, k_cache, v_cache, slot_mapping):
        return
    idx = slot_mapping.long()
    keep = idx >= 0
    t, bs = idx.shape[0], k_cache.shape[1]
    blk, off = idx[keep] // bs, idx[keep] % bs  # (block, offset) indexing works for any cache strides
    k_cache[blk, off] = k[:t][keep].to(k_cache.dtype)
    v_cache[blk, off] = v[:t][keep].to(v_cache.dtype)

"""Causal GQA attention: packed varlen prefill, paged-KV queries, the KV write
(contract: rlkernel/contracts/attention.py)."""
from __future__ import annotations

import torch

from .. import dispatch
from ._dtypes import data_dtype
from ..backends import cpu as _cpu
from ..backends.triton import ops as _triton


def _check(q, k, v):
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"attention: want q [T, Hq, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: q head_dim {q.shape[-1]} != k/v head_dim {k.shape[-1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads cannot share {k.shape[1]} kv heads")


def _index(name: str, t, dims: int) -> None:
    """An index argument: an integer tensor of `dims` dimensions (a float one would be truncated, a bool one read as 0/1)."""
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dims}-D integer tensor, got {got}")


def _offsets(name: str, offsets, total: int, padded: bool = False) -> None:
    """Row offsets [B+1] (cu_seqlens, query_start_loc) checked where they are host memory (CPU tensors: a read here is
    free; on a GPU it would wait for the device, and the kernels bound their own reads): from 0, non-decreasing, to
    `total` — or, `padded`, to at most `total` (an engine pads a decode batch to a captured size: rows past the last
    offset are padding) — the CPU kernels index the rows by them without bounds checks."""
    if offsets.device.type != "cpu" or offsets.numel() == 0:
        if offsets.numel() == 0:
            raise ValueError(f"{name} must hold B+1 >= 1 offsets, got none")
        return
    o = offsets.long()
    if int(o[0]) != 0 or (int(o[-1]) > total if padded else int(o[-1]) != total) or bool((o[1:] < o[:-1]).any()):
        shown = o.tolist() if o.numel() <= 12 else o[:6].tolist() + ["..."] + o[-3:].tolist()
        end = f"end within the {total} rows" if padded else f"end at the row count {total}"
        raise ValueError(f"{name} must start at 0, not decrease and {end}; got {shown}")


def attention_varlen(q, k, v, cu_seqlens, *, scale: float | None = None, backend: str | None = None,
                     max_seqlen: int | None = None) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1] (int).

    max_seqlen: a bound >= the longest sequence, when the host has it (Megatron's PackedSeqParams does); a GPU
    implementation then launches without reading it back (no device sync; a device-side assert checks it). It sizes
    the launch only, never a value."""
    _check(q, k, v)
    data_dtype("attention_varlen", q=q, k=k, v=v)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"attention_varlen: q has {q.shape[0]} rows but k/v have {k.shape[0]} (packed: one key row per query row)")
    _index("attention_varlen: cu_seqlens", cu_seqlens, 1)
    _offsets("attention_varlen: cu_seqlens", cu_seqlens, q.shape[0])
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
    data_dtype("attention_paged", q=q, k_cache=k_cache, v_cache=v_cache)
    _index("attention_paged: block_tables", block_tables, 2)
    _index("attention_paged: seq_lens", seq_lens, 1)
    _index("attention_paged: query_start_loc", query_start_loc, 1)
    B = seq_lens.shape[0]
    if query_start_loc.shape[0] != B + 1 or block_tables.shape[0] < B:
        raise ValueError(f"attention_paged: {B} requests (seq_lens) want query_start_loc [{B + 1}] and block_tables with >= {B} "
                         f"rows; got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    _offsets("attention_paged: query_start_loc", query_start_loc, q.shape[0], padded=True)
    if block_tables.device.type == "cpu" and B:  # the blocks each request reads, within the cache (host memory: free)
        lens, bs = seq_lens.long(), k_cache.shape[1]
        if int(lens.min()) < 0:
            raise ValueError(f"attention_paged: seq_lens must be >= 0, got {int(lens.min())}")
        used = (lens + bs - 1) // bs
        if int(used.max()) > block_tables.shape[1]:
            raise ValueError(f"attention_paged: a request of {int(lens.max())} tokens needs {int(used.max())} blocks of "
                             f"{bs}; block_tables has {block_tables.shape[1]} columns")
        ids = block_tables[:B].long()[torch.arange(block_tables.shape[1]) < used[:, None]]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k_cache.shape[0]):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"attention_paged: block_tables names block {bad}, outside the cache's [0, {k_cache.shape[0]})")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    hints = {k: int(v) for k, v in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)) if v is not None}
    return dispatch.call("attention", backend, (q, k_cache, v_cache), "paged", q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                         **hints)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Copy k/v [T, Hkv, D] into the caches at flat slots (block * block_size + offset); exact copies.
    Negative slots (vLLM's padding, PAD_SLOT_ID = -1) are skipped."""
    if k.dim() != 3 or k.shape != v.shape or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"write_kv_cache: want k/v [T, Hkv, D] equal in shape and caches [blocks, block_size, Hkv, D] of the same "
                         f"Hkv and D; got k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    data_dtype("write_kv_cache", k=k, v=v, k_cache=k_cache, v_cache=v_cache)  # exact copies: no rounding into the cache
    _index("write_kv_cache: slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(f"write_kv_cache: {slot_mapping.shape[0]} slots for {k.shape[0]} keys")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel() and int(slot_mapping.max()) >= k_cache.shape[0] * k_cache.shape[1]:
        raise ValueError(f"write_kv_cache: slot {int(slot_mapping.max())} is outside the cache's "
                         f"{k_cache.shape[0] * k_cache.shape[1]} slots")
    if _cpu.write_kv(k, v, k_cache, v_cache, slot_mapping) or _triton.write_kv(k, v, k_cache, v_cache, slot_mapping):
        return
    idx = slot_mapping.long()
    keep = idx >= 0
    t, bs = idx.shape[0], k_cache.shape[1]
    blk, off = idx[keep] // bs, idx[keep] % bs  # (block, offset) indexing works for any cache strides
    k_cache[blk, off] = k[:t][keep].to(k_cache.dtype)
    v_cache[blk, off] = v[:t][keep].to(v_cache.dtype)

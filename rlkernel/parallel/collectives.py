"""Deterministic collectives: reductions over ranks whose bits do not depend on the world size.

What this module decides: how a sum over ranks and the vocab-parallel logprob
are reduced. Why: `dist.all_reduce` adds per-rank partial sums in whatever order
the backend's algorithm picks (ring chunks start at different ranks, NCCL picks
ring or tree by message size), and each rank's partial already fixed a grouping
that depends on how many ranks share the work. So TP=2 and TP=4 round
differently, and neither matches TP=1.

The strict path reduces over *canonical segments*, not ranks: the payload is cut
into S segments (S fixed by the model, not by the world size); rank r owns the
contiguous block r*k .. r*k+k-1. Segments travel unchanged in their own dtype
(all_gather, rank order — no arithmetic in transit), and every rank sums all S
with one balanced binary tree over segment index, accumulating in float32 and
rounding once. The result is a function of the segments alone: identical on
every rank, for any world size dividing S, and equal to `canonical_tree_sum` in
one process. The price: every rank receives every rank's share (an all-reduce moves
about 2 payloads); where a rank's k segments are a power of two, their block is a
subtree of the canonical tree, so each rank sums its subtree first and only the
world float32 partials travel; otherwise all S segments do. Tensors
never leave their device (signatures included), so the same code runs on gloo
(CPU) and NCCL (CUDA).

`vocab_parallel_logprob` applies the same idea to linear-logprob: vocab tiles are
the canonical segments, so the (m, l) merge runs over the global tile list and
reproduces `rlkernel.linear_logprob` bit for bit when shards are tile-aligned.

Input checks that need other ranks' view (shapes, shard ranges) gather a small
signature first, so a mismatch raises the same ValueError on every rank instead
of hanging one of them inside a collective.
"""
from __future__ import annotations

import zlib
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .. import dispatch

from ..backends.reference import logprob as _lp
from ..backends.reference.primitives import tree_sum
from ..contracts.collectives import ALL_GATHER_REFERENCE, ALL_REDUCE_NATIVE, ALL_REDUCE_REFERENCE, VOCAB_PARALLEL_LOGPROB_REFERENCE
from ..contracts.logprob import VOCAB_TILE

__all__ = [
    "ALL_REDUCE_REFERENCE",
    "ALL_REDUCE_NATIVE",
    "ALL_GATHER_REFERENCE",
    "VOCAB_PARALLEL_LOGPROB_REFERENCE",
    "canonical_tree_sum",
    "tree_all_reduce",
    "native_all_reduce",
    "all_gather",
    "vocab_parallel_logprob",
    "vocab_parallel_entropy",
]

def _strict_logprob_impl(device: torch.device):
    """The strict implementation that serves linear-logprob on `device` now (its call noted in the provenance)."""
    impl = dispatch.resolve("linear_logprob", device, "strict")
    dispatch.note_call("linear_logprob", impl, (torch.empty(0, device=device),))
    return impl


def strict_prims(device: torch.device):
    """The primitives of the strict implementation that serves linear-logprob on `device` now."""
    return _strict_logprob_impl(device).prims


# ---- the Triton implementation's vocab tiles (GPU contract): its fused kernel's tiles and tree, split over ranks ----
# The GPU linear-logprob tiles the vocab by the kernel's block_n (not VOCAB_TILE) and merges the tiles' (m, l) in its
# own tree kernel; the shards (VOCAB_TILE multiples) hold whole kernel tiles, so every rank runs the kernel's first
# stage on its shard, the stages are gathered, and every rank runs the kernel's tree over the global tile list: the
# bits of the one-GPU `rk.linear_logprob` / `rk.linear_entropy`.

def _triton_tiles(dtype: torch.dtype, meta) -> list[int]:
    from ..backends.triton import logprob as tlp

    bn = tlp.tile_rows(dtype)
    if VOCAB_TILE % bn:
        raise ValueError(f"vocab_parallel: the kernel's vocab tile ({bn}) does not divide VOCAB_TILE={VOCAB_TILE}")
    return [-(-(end - start) // bn) for start, end, *_ in meta]


def _triton_stage(hidden, weight_shard, local_targets, temperature, n_rows, width):
    """This rank's packed kernel tiles (the first stage of the fused kernel) over its n_rows rows."""
    from ..backends.triton import logprob as tlp

    ml, zt = tlp.tile_stats(hidden.contiguous(), weight_shard, local_targets, temperature, n_rows)
    own = (local_targets >= 0) & (local_targets < n_rows)
    return _pack_tile_stats(ml[..., 0].t(), ml[..., 1].t(), zt, own, width)


def _triton_merge(gathered, meta, counts, width):
    """(log p [T], lse [T]) from every rank's stage: the kernel's own tree over the global tile list."""
    from ..backends.triton import logprob as tlp

    ms, ls, zt = _unpack_tile_stats(gathered, meta, counts, width)
    out, stats = tlp.merge_tiles(torch.stack([torch.stack(ms, dim=1), torch.stack(ls, dim=1)], dim=-1), zt)
    return out, stats[:, 0] + stats[:, 1]


def _triton_vocab_parallel(hidden, weight_shard, local_targets, n_rows, meta, temperature, group):
    counts = _triton_tiles(hidden.dtype, meta)
    stage = _triton_stage(hidden, weight_shard, local_targets, temperature, n_rows, max(counts))
    return _triton_merge(_gather(stage, group), meta, counts, max(counts))


def _world(group) -> tuple[int, int]:
    """(world_size, rank); (1, 0) without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    """[world, *t.shape]: every rank's t, stacked in rank order."""
    world, _ = _world(group)
    t = t.contiguous()
    if world == 1:
        return t.unsqueeze(0)
    outs = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(outs, t, group=group)
    return torch.stack(outs)


def _gather_ints(values: Sequence[int], device: torch.device, group) -> list[list[int]]:
    """Every rank's `values`, in rank order. Alone, no tensor: on a GPU the round trip would stall the host (a sync
    per call: hundreds per strict update)."""
    if _world(group)[0] == 1:
        return [list(values)]
    return _gather(torch.tensor(list(values), dtype=torch.int64, device=device), group).tolist()


def _signature(shape, dtype) -> int:
    # crc32, not hash(): str hashes are salted per process and would never agree.
    return zlib.crc32(repr((tuple(shape), str(dtype))).encode())


def _check_segments(segments: Sequence[torch.Tensor], who: str) -> None:
    if not isinstance(segments, (list, tuple)) or len(segments) == 0:
        raise ValueError(f"{who}: want a non-empty list or tuple of tensors, got {type(segments).__name__}" + (" (empty)" if isinstance(segments, (list, tuple)) else ""))
    s0 = segments[0]
    for i, s in enumerate(segments):
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"{who}: segment {i} is a {type(s).__name__}, not a tensor")
        if s.shape != s0.shape or s.dtype != s0.dtype or s.device != s0.device:
            raise ValueError(f"{who}: segment {i} is {tuple(s.shape)} {s.dtype} on {s.device}, segment 0 is {tuple(s0.shape)} {s0.dtype} on {s0.device}; all segments must match")


def _tree_reduce(stacked: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by the canonical tree; float32 accumulation (wider dtypes keep theirs), one final cast."""
    dtype = stacked.dtype
    acc = torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype
    return tree_sum(stacked.to(acc), dim=0).to(dtype)


def canonical_tree_sum(segments: Sequence[torch.Tensor]) -> torch.Tensor:
    """The single-process definition of the strict all-reduce: the canonical tree over `segments`."""
    _check_segments(segments, "canonical_tree_sum")
    return _tree_reduce(torch.stack(list(segments)))


def tree_all_reduce(local_segments: Sequence[torch.Tensor], group=None, *, check: bool = True,
                    gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Sum of all ranks' canonical segments, bitwise equal on every rank to `canonical_tree_sum`.

    local_segments: this rank's k segments (rank r owns r*k .. r*k+k-1), same
    shape/dtype/device; every rank passes the same k. Returns the payload dtype.
    Without a process group it is `canonical_tree_sum(local_segments)`.
    check: first gather every rank's (k, shape, dtype) and raise where they differ (a clear error instead of a
    collective of mismatched sizes) — one more collective, and on a GPU a host wait for the device (the ints come back
    to the host). check=False: the caller guarantees the ranks agree — rlkernel's own layers (one model, one batch on
    every rank of a TP / CP group), which call this twice a transformer layer, so a decode step at TP > 1 would wait
    for the device twice a layer. The same bits either way.
    gather: every rank's tensor stacked [world, *shape] in rank order, by another communicator than
    torch.distributed's all_gather on `group` (a rollout engine's own: vLLM's TP group coordinator, which CUDA graphs
    can capture); `group` still gives the world size. It moves data only, so the bits are the same.
    """
    _check_segments(local_segments, "tree_all_reduce")
    s0 = local_segments[0]
    if check:
        sigs = _gather_ints([len(local_segments), _signature(s0.shape, s0.dtype)], s0.device, group)
        if any(s != sigs[0] for s in sigs):
            raise ValueError(f"tree_all_reduce: ranks disagree on segment count/shape/dtype: per-rank (k, signature) {sigs}; this rank has k={len(local_segments)} of {tuple(s0.shape)} {s0.dtype}")
    k = len(local_segments)
    gather = gather or (lambda t: _gather(t, group))
    if k >= 2 and k & (k - 1) == 0 and _world(group)[0] > 1:
        # k a power of two: this rank's block is an aligned subtree of the canonical tree (zero padding lies beyond
        # every block), so the tree over the ranks' subtree sums *is* the canonical tree: reduce locally first and
        # move one float32 partial per rank instead of k segments (the adds are the same adds on the same values)
        acc = torch.promote_types(s0.dtype, torch.float32) if s0.dtype.is_floating_point else s0.dtype
        partial = tree_sum(torch.stack(list(local_segments)).to(acc), dim=0)
        return tree_sum(gather(partial), dim=0).to(s0.dtype)
    gathered = gather(torch.stack(list(local_segments)))  # [world, k, *shape], rank-major = segment order
    return _tree_reduce(gathered.reshape(-1, *s0.shape))


def native_all_reduce(local_segments: Sequence[torch.Tensor], group=None) -> torch.Tensor:
    """The production path (ALL_REDUCE_NATIVE): local left-to-right sum, then dist.all_reduce. For ablations and negative controls."""
    _check_segments(local_segments, "native_all_reduce")
    out = local_segments[0].clone()
    for s in local_segments[1:]:
        out = out + s
    if _world(group)[0] > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_gather(tensor: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim` in rank order; shapes and dtypes must match across ranks."""
    if tensor.dim() == 0 or not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"all_gather: dim {dim} out of range for a tensor of shape {tuple(tensor.shape)}")
    sigs = _gather_ints([_signature(tensor.shape, tensor.dtype)], tensor.device, group)
    if any(s != sigs[0] for s in sigs):
        raise ValueError(f"all_gather: ranks disagree on shape/dtype (per-rank signatures {[s[0] for s in sigs]}); this rank has {tuple(tensor.shape)} {tensor.dtype}")
    return torch.cat(_gather(tensor, group).unbind(0), dim=dim)


def _check_shards(ranges: list[list[int]], vocab_size: int) -> None:
    """Shards must tile [0, vocab_size) exactly once, every boundary on a VOCAB_TILE multiple (or at vocab_size)."""
    tile = VOCAB_TILE
    for r, (lo, hi) in enumerate(ranges):
        for b in (lo, hi) if hi > lo else ():
            if b % tile and b != vocab_size:
                raise ValueError(
                    f"vocab_parallel_logprob: rank {r}'s shard boundary {b} is not a multiple of VOCAB_TILE={tile}; a tile "
                    f"split across ranks would change the (m, l) merge tree (per-rank ranges {ranges})"
                )
    end = 0
    for lo, hi in sorted(rh for rh in ranges if rh[1] > rh[0]):
        if lo != end:
            raise ValueError(f"vocab_parallel_logprob: shards must cover [0, {vocab_size}) once, contiguously; per-rank true-vocab ranges {ranges}")
        end = hi
    if end != vocab_size:
        raise ValueError(f"vocab_parallel_logprob: shards cover [0, {end}) but the vocab is [0, {vocab_size}); per-rank ranges {ranges}")


def _vocab_shards(who, hidden, weight_shard, vocab_start, vocab_size, temperature, group, check=True):
    """Checks shared by the vocab-parallel ops; (this rank's [lo, hi), every rank's meta, tiles per rank).
    check=False: the ranks' ranges are computed, not gathered (see vocab_parallel_logprob)."""
    if hidden.dim() != 2 or weight_shard.dim() != 2 or weight_shard.shape[1] != hidden.shape[1]:
        raise ValueError(f"{who}: want hidden [T, H], weight_shard [rows, H]; got {tuple(hidden.shape)}, {tuple(weight_shard.shape)}")
    if vocab_size <= 0 or vocab_start < 0 or not temperature > 0:
        raise ValueError(f"{who}: need vocab_size > 0, vocab_start >= 0, temperature > 0; got {vocab_size}, {vocab_start}, {temperature}")
    rows = weight_shard.shape[0]
    lo, hi = min(vocab_start, vocab_size), min(vocab_start + rows, vocab_size)
    if check:
        meta = _gather_ints([lo, hi, hidden.shape[0], vocab_size], hidden.device, group)
        if any(m[2:] != meta[0][2:] for m in meta):
            raise ValueError(f"{who}: ranks disagree on (tokens, vocab_size): {[m[2:] for m in meta]}")
    else:
        world, rank = _world(group)
        if vocab_start != rank * rows:
            raise ValueError(f"{who}(check=False): the computed layout puts rank r's shard at r * rows; rank {rank} holds "
                             f"{rows} rows from vocab_start {vocab_start}, not {rank * rows}: pass check=True for another layout")
        meta = [[min(r * rows, vocab_size), min((r + 1) * rows, vocab_size), hidden.shape[0], vocab_size] for r in range(world)]
    _check_shards([m[:2] for m in meta], vocab_size)
    return (lo, hi), meta, [-(-(end - start) // VOCAB_TILE) for start, end, *_ in meta]


def _in_vocab_order(gathered: torch.Tensor, meta, n_tiles, offset: int = 0) -> list[torch.Tensor]:
    """The per-tile rows of every rank's gathered buffer, in global tile order."""
    out = []
    for r in sorted(range(len(meta)), key=lambda r: meta[r][0]):  # vocab order; _check_shards made it unambiguous
        out += list(gathered[r][offset : offset + n_tiles[r]])
    return out


def _pack_tile_stats(ms, ls, zt, own, width):
    """[2 * width + 2, T]: a rank's per-tile m and l ([its tiles, T] each, padded to `width` tiles: ranks own different
    tile counts), its target logits and where it owns the target."""
    buf = torch.zeros(2 * width + 2, zt.shape[0], device=zt.device)
    buf[: ms.shape[0]], buf[width : width + ls.shape[0]] = ms, ls
    buf[2 * width], buf[2 * width + 1] = zt, own.float()
    return buf


def _unpack_tile_stats(gathered, meta, counts, width):
    """Every rank's packed stats [world, 2 * width + 2, T] -> (m of every tile in vocab order, l likewise, each row's
    target logit from the rank that owns it)."""
    zt = torch.zeros_like(gathered[0][0])
    for g in gathered:  # exactly one rank owns each target: a select, not a sum
        zt = torch.where(g[2 * width + 1] > 0, g[2 * width], zt)
    return _in_vocab_order(gathered, meta, counts), _in_vocab_order(gathered, meta, counts, width), zt


def _gather_tile_stats(ms, ls, zt, own, counts, meta, group):
    width = max(counts)
    return _unpack_tile_stats(_gather(_pack_tile_stats(ms, ls, zt, own, width), group), meta, counts, width)


def _sum_tiles_over_ranks(parts, counts, meta, group):
    """Every rank's per-tile values ([its tiles, T]) summed by one balanced tree over the global tile list."""
    buf = torch.zeros(max(counts), parts.shape[1], device=parts.device)
    buf[: parts.shape[0]] = parts
    return tree_sum(torch.stack(_in_vocab_order(_gather(buf, group), meta, counts), dim=-1), dim=-1)


@torch.no_grad()
def vocab_parallel_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, *, vocab_start: int, vocab_size: int, temperature: float = 1.0,
                           group=None, check: bool = True) -> torch.Tensor:
    """float32 entropy of softmax(hidden @ lm_head.T / T) over the true vocab, the lm_head split over ranks by
    vocab rows; forward only. The global log-sum-exp is the (m, l) tile tree of `vocab_parallel_logprob`; each
    rank then sums p*z inside its tiles, the per-tile sums are gathered and summed by the tree of
    `rlkernel.linear_entropy` over the global tile list — bitwise equal to it on every rank. check: as in
    `vocab_parallel_logprob`."""
    (lo, hi), meta, n_tiles = _vocab_shards("vocab_parallel_entropy", hidden, weight_shard, vocab_start, vocab_size, temperature, group,
                                            check)
    impl = _strict_logprob_impl(hidden.device)
    if impl.name == "triton":
        from ..backends.triton import ops as tops

        no_target = torch.full(hidden.shape[:1], -1, dtype=torch.long, device=hidden.device)
        _, lse = _triton_vocab_parallel(hidden, weight_shard, no_target, hi - lo, meta, temperature, group)
        parts = tops.entropy_tile_sums(hidden.contiguous(), weight_shard, lse, temperature, 0, hi - lo).t()  # [tiles, T]
        return lse - _sum_tiles_over_ranks(parts, n_tiles, meta, group)
    prims, h32, T = impl.prims, hidden.float(), hidden.shape[0]
    zs = [_lp.tile_logits(h32, weight_shard, a - vocab_start, min(a + VOCAB_TILE, vocab_size) - vocab_start, temperature, prims)
          for a in range(lo, hi, VOCAB_TILE)]
    ms = torch.stack([z.amax(dim=-1) for z in zs]) if zs else torch.zeros(0, T, device=hidden.device)
    ls = torch.stack([tree_sum(prims.exp(z - m[:, None]), dim=-1) for z, m in zip(zs, ms)]) if zs else ms
    none = torch.zeros(T, device=hidden.device)
    ms, ls, _ = _gather_tile_stats(ms, ls, none, none.bool(), n_tiles, meta, group)
    m, l = _lp.tree_merge_ml(ms, ls, prims)
    lse = m + prims.log(l)
    parts = torch.stack([tree_sum(prims.exp(z - lse[:, None]) * z, dim=-1) for z in zs]) if zs else torch.zeros(0, T, device=hidden.device)
    return lse - _sum_tiles_over_ranks(parts, n_tiles, meta, group)


@torch.no_grad()
def vocab_parallel_logprob(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int, temperature: float = 1.0, group=None,
                           return_lse: bool = False, check: bool = True):
    """float32 log p(targets) with the lm_head split over ranks by vocab rows; forward only (no autograd).

    hidden [T, H] and targets [T] are the same on every rank; weight_shard holds
    lm_head rows [vocab_start, vocab_start + weight_shard.shape[0]) of a possibly
    padded vocab, rows >= vocab_size are padding and never read. Each rank turns
    its tiles (anchored at absolute multiples of VOCAB_TILE) into (m, l) and its
    owned target logits; these are gathered and every rank merges the global
    tile list in tile order — the tree of `rlkernel.linear_logprob`, so the result
    is bitwise equal to it on every rank. Shard boundaries that are not tile
    multiples raise ValueError on every rank. On the GPU (the Triton implementation)
    the tiles and the tree are its fused kernel's, so the result equals the one-GPU
    `rlkernel.linear_logprob` bit for bit likewise. return_lse: also the log-sum-exp [T].
    check: first gather every rank's shard range, token count and vocab size (any contiguous tile-aligned layout;
    ranks that disagree raise on every rank) — one more collective, and on a GPU a host wait for the device (the ints
    come back to the host) a call. check=False: the caller guarantees the layout rlkernel's own TP heads use — every
    rank holds weight_shard.shape[0] rows from rank * that, the same hidden rows and vocab_size on every rank — so the
    ranges are computed on each rank (a vocab_start off that layout raises here; the tile-boundary checks still run).
    The same bits either way.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"vocab_parallel_logprob: want hidden [T, H], targets [T]; got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    targets = targets.long()
    if targets.numel() and targets.is_cuda:  # a device-side assert: no read-back in the middle of the forward
        torch._assert_async(((targets >= 0) & (targets < vocab_size)).all(), "vocab_parallel_logprob: targets outside the vocab")
    elif targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"vocab_parallel_logprob: targets outside [0, {vocab_size})")
    (lo, hi), meta, n_tiles = _vocab_shards("vocab_parallel_logprob", hidden, weight_shard, vocab_start, vocab_size, temperature, group,
                                            check)
    impl = _strict_logprob_impl(hidden.device)
    local_t = targets - vocab_start
    if impl.name == "triton":
        lp, lse = _triton_vocab_parallel(hidden, weight_shard, local_t, hi - lo, meta, temperature, group)
        return (lp, lse) if return_lse else lp
    prims, h32, T = impl.prims, hidden.float(), hidden.shape[0]
    ms, ls = [], []
    zt = torch.zeros(T, device=hidden.device)
    own_any = torch.zeros(T, dtype=torch.bool, device=hidden.device)
    for a in range(lo, hi, VOCAB_TILE):
        b = min(a + VOCAB_TILE, vocab_size)
        # Offsets relative to the shard select exactly the rows tile [a, b) has in the full lm_head.
        m, l, z, own = _lp.tile_stats(h32, weight_shard, local_t, a - vocab_start, b - vocab_start, temperature, prims)
        ms.append(m)
        ls.append(l)
        zt, own_any = torch.where(own, z, zt), own_any | own
    empty = torch.zeros(0, T, device=hidden.device)
    ms, ls, zt = _gather_tile_stats(torch.stack(ms) if ms else empty, torch.stack(ls) if ls else empty, zt, own_any, n_tiles, meta, group)
    m, l = _lp.tree_merge_ml(ms, ls, prims)
    log_l = prims.log(l)
    lp = (zt - m) - log_l
    return (lp, m + log_l) if return_lse else lp

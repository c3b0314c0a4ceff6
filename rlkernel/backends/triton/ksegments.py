"""The canonical K segments of a row-parallel GEMM inside one launch (gemm.matmul's "registers", "stream", "scratch"
and "fixup" schedules): each segment its own fp32 accumulator from zero, merged by the balanced binary tree
((s0 + s1) + (s2 + s3)) ... in fp32, the bits of one plain GEMM per segment summed by rlkernel.tree_sum. Device code
only; which schedule runs is the host's (gemm.matmul, ops.segment_schedule)."""
from __future__ import annotations

import triton
import triton.language as tl

from .tile import _dot, _k_loop, _k_span

@triton.jit
def _kept(x, M):
    """x, behind a select on a runtime condition that always holds (M > 0: a launch has rows): the tree's fp32 adds
    below must add a segment's rounded partial. Triton's combine pass (CombineDotAddFPattern) rewrites
    addf(dot(a, b, 0), d) into dot(a, b, d), which accumulates the products onto d inside the tensor-core chain
    instead of rounding them first: another order. It fires where a segment's K loop runs once (a segment of at most
    block_k, e.g. 576 / 4 = 144 at block_k 256) and the loop folds away: session 18 on the H200, "registers" rows
    differed from "launches" / "split" / "fixup" at the SmolLM2 and toy widths. A select is no dot, so nothing
    combines; its cost is one select per accumulator element per segment."""
    return tl.where(M > 0, x, 0.0)


@triton.jit
def _k_segments(a_src, b_src, off_m, off_n, M, N, K, sam, sak, sbn, sbk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                TMA: tl.constexpr, B_NK: tl.constexpr, IEEE: tl.constexpr, SEGS: tl.constexpr):
    """SEGS equal K segments, each its own accumulator from zero, merged by the balanced binary
    tree ((s0 + s1) + (s2 + s3)) ... in fp32: the canonical-segment layout of a row-parallel GEMM.
    Each partial passes `_kept` before its add (no dot-add combine: the same bits as the other schedules)."""
    if SEGS == 1:
        return _k_loop(a_src, b_src, off_m, off_n, M, N, K, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N, BLOCK_K, TMA, B_NK,
                       IEEE)
    ks = K // SEGS
    s0 = _kept(_k_span(a_src, b_src, off_m, off_n, M, N, 0, ks, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N, BLOCK_K, TMA,
                       B_NK, IEEE), M)
    s1 = _kept(_k_span(a_src, b_src, off_m, off_n, M, N, ks, 2 * ks, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N, BLOCK_K, TMA,
                       B_NK, IEEE), M)
    acc = s0 + s1
    if SEGS >= 4:
        s2 = _kept(_k_span(a_src, b_src, off_m, off_n, M, N, 2 * ks, 3 * ks, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N,
                           BLOCK_K, TMA, B_NK, IEEE), M)
        s3 = _kept(_k_span(a_src, b_src, off_m, off_n, M, N, 3 * ks, 4 * ks, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N,
                           BLOCK_K, TMA, B_NK, IEEE), M)
        acc = acc + (s2 + s3)
    if SEGS == 8:
        s4 = _kept(_k_span(a_src, b_src, off_m, off_n, M, N, 4 * ks, 5 * ks, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N,
                           BLOCK_K, TMA, B_NK, IEEE), M)
        s5 = _kept(_k_span(a_src, b_src, off_m, off_n, M, N, 5 * ks, 6 * ks, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N,
                           BLOCK_K, TMA, B_NK, IEEE), M)
        s6 = _kept(_k_span(a_src, b_src, off_m, off_n, M, N, 6 * ks, 7 * ks, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N,
                           BLOCK_K, TMA, B_NK, IEEE), M)
        s7 = _kept(_k_span(a_src, b_src, off_m, off_n, M, N, 7 * ks, 8 * ks, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N,
                           BLOCK_K, TMA, B_NK, IEEE), M)
        acc = acc + ((s4 + s5) + (s6 + s7))
    return acc


@triton.jit
def _tree4(lo, hi, part, s):
    """Segment s's partial joins the balanced 4-leaf tree ((s0 + s1) + (s2 + s3)) as it ends: s0; s0 + s1; s2;
    (s0 + s1) + (s2 + s3). Returns (lo, hi). `_k_stream` folds through it with s at run time, gemm_gluon's
    warp-specialised consumer with s a constexpr (Gluon inlines @triton.jit functions)."""
    if s == 0:
        lo = part
    elif s == 1:
        lo = lo + part
    elif s == 2:
        hi = part
    else:
        lo = lo + (hi + part)
    return lo, hi


@triton.jit
def _k_stream(a_src, b_src, off_m, off_n, M, N, K, sam, sak, sbn, sbk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              TMA: tl.constexpr, B_NK: tl.constexpr, IEEE: tl.constexpr, SEGS: tl.constexpr):
    """_k_segments' result (SEGS = 2 or 4) from one K loop that starts at zero: the accumulator restarts at
    every segment boundary and each finished segment is folded into the tree as it completes (s0; s0 + s1;
    s2; (s0 + s1) + (s2 + s3)), so the pipeliner sees one loop with no restart per segment. Needs K (compiled
    in) a multiple of SEGS * BLOCK_K."""
    seg_iters = (K // SEGS) // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lo = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hi = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not TMA:
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        rm = tl.max_contiguous(tl.multiple_of(tl.where(rm < M, rm, 0), BLOCK_M), BLOCK_M)
        rn = tl.max_contiguous(tl.multiple_of(tl.where(rn < N, rn, 0), BLOCK_N), BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
    for ki in range(K // BLOCK_K):
        if TMA:
            a = a_src.load([off_m, ki * BLOCK_K])
            if B_NK:
                b = b_src.load([off_n, ki * BLOCK_K]).T
            else:
                b = b_src.load([ki * BLOCK_K, off_n])
        else:
            kk = ki * BLOCK_K + rk
            a = tl.load(a_src + rm[:, None].to(tl.int64) * sam + kk[None, :] * sak)
            b = tl.load(b_src + kk[:, None] * sbk + rn[None, :].to(tl.int64) * sbn)
        acc = _dot(a, b, acc, IEEE)
        if (ki + 1) % seg_iters == 0:  # segment s just ended
            s = (ki + 1) // seg_iters - 1
            part = _kept(acc, M)  # the rounded partial (no dot-add combine, see _kept)
            if SEGS == 2:
                if s == 0:
                    lo = part
                else:
                    lo = lo + part
            else:
                lo, hi = _tree4(lo, hi, part, s)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return lo


@triton.jit
def _k_scratch(a_src, b_src, off_m, off_n, M, N, K, sam, sak, sbn, sbk, slot_ptr, c_ptr, scm, scn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               TMA: tl.constexpr, B_NK: tl.constexpr, IEEE: tl.constexpr, SEGS: tl.constexpr, TREE: tl.constexpr,
               SLICED: tl.constexpr):
    """_k_segments' result with one accumulator live in any K loop: each segment's partial (behind _kept) is merged
    into the finished subtrees of the balanced binary tree as it completes, and a subtree awaiting its right sibling
    waits in this program's fp32 slots in global memory (slot_ptr: TREE = log2(SEGS) tiles of [BLOCK_M, BLOCK_N],
    reused tile after tile, so L2-resident), not in registers: the tile need not be fitted to the tree's live accumulators
    (segments_config halves its columns) and keeps the table's width. Exact fp32 stores and loads, the same adds in
    the same order (left + right): the bits of every other schedule.
    SLICED (large tiles: a loaded subtree beside the accumulator spills, 128 x 256 on sm_90): a merge first stores the
    partial too (one more slot, after the tree's) and adds by 32-row slices from memory; the last merge stores the
    cast result into c itself (the caller stores nothing). Returns the tile's sum (not SLICED) or the last partial."""
    ks = K // SEGS
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    SUB: tl.constexpr = 32 if BLOCK_M > 32 else BLOCK_M
    r = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    x = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.static_range(SEGS):
        x = _kept(_k_span(a_src, b_src, off_m, off_n, M, N, i * ks, i * ks + ks, sam, sak, sbn, sbk,
                          BLOCK_M, BLOCK_N, BLOCK_K, TMA, B_NK, IEEE), M)
        if SLICED and (i & 1):  # merges from memory: the partial joins the slots, then slice by slice
            cur = slot_ptr + TREE * TILE
            tl.debug_barrier()
            tl.store(cur + r, x)
            tl.debug_barrier()
            rn = off_n + tl.arange(0, BLOCK_N)
            for rs in tl.static_range(0, BLOCK_M, SUB):
                rr = (rs + tl.arange(0, SUB))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                v = tl.load(cur + rr)
                lvl = 0
                for _ in tl.static_range(3):
                    if (i >> lvl) & 1:
                        v = tl.load(slot_ptr + lvl * TILE + rr) + v
                        lvl += 1
                if i == SEGS - 1:
                    rm = off_m + rs + tl.arange(0, SUB)
                    tl.store(c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn, v.to(c_ptr.dtype.element_ty),
                             mask=(rm[:, None] < M) & (rn[None, :] < N))
                else:
                    tl.store(slot_ptr + lvl * TILE + rr, v)
        else:
            lvl = 0
            for _ in tl.static_range(3):  # at most log2(8) merges: each finished left sibling at its level
                if (i >> lvl) & 1:
                    tl.debug_barrier()  # every thread's store of the sibling is visible to every thread's load
                    x = tl.load(slot_ptr + lvl * TILE + r) + x
                    lvl += 1
            if i < SEGS - 1:
                tl.debug_barrier()  # the previous tile's (or subtree's) loads of this slot are done before its rewrite
                tl.store(slot_ptr + lvl * TILE + r, x)
    return x


@triton.jit
def _fixup_merge(ws_ptr, c_ptr, off_m, rn, M, N, scm, scn, BLOCK_M: tl.constexpr, SEGS: tl.constexpr):
    """A tile's SEGS fp32 partials (rows s*M + m of ws [SEGS*M, N]) merged by _k_segments' tree,
    ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), cast and stored into c. By 32-row slices:
    an element's sum is the same, and a slice's partials fit in registers (a whole 128 x 128
    tile's spilled, sm_90 ptxas). .cg: read from L2, never a line this SM's L1 may hold from
    before the other programs' stores."""
    SUB: tl.constexpr = 32 if BLOCK_M > 32 else BLOCK_M
    step = M.to(tl.int64) * N
    for r in tl.static_range(0, BLOCK_M, SUB):
        rm = off_m + r + tl.arange(0, SUB)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        base = ws_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
        acc = (tl.load(base, mask=mask, other=0.0, cache_modifier=".cg")
               + tl.load(base + step, mask=mask, other=0.0, cache_modifier=".cg"))
        if SEGS >= 4:
            acc = acc + (tl.load(base + 2 * step, mask=mask, other=0.0, cache_modifier=".cg")
                         + tl.load(base + 3 * step, mask=mask, other=0.0, cache_modifier=".cg"))
        if SEGS == 8:
            hi = (tl.load(base + 4 * step, mask=mask, other=0.0, cache_modifier=".cg")
                  + tl.load(base + 5 * step, mask=mask, other=0.0, cache_modifier=".cg"))
            hi = hi + (tl.load(base + 6 * step, mask=mask, other=0.0, cache_modifier=".cg")
                       + tl.load(base + 7 * step, mask=mask, other=0.0, cache_modifier=".cg"))
            acc = acc + hi
        ptrs = c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

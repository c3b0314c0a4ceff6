#!/usr/bin/env python3
"""An experiment, not a contract yet: the strict attention prefill (packed varlen, causal, GQA) written in Gluon with
warp specialisation, bit-checked against the production Triton kernel and timed against it and SDPA.

Why: issue 10 asks attention prefill >= 0.85x SDPA; production runs at 0.73x (session 25: 420 vs 575 TFLOP/s,
8 x 4,096, 32 / 8 heads, D 128). Session 27 ran `gpu_gluon_ws.py` on the H200: Gluon's warp-specialised wgmma chains
give the strict GEMM's bits exactly, so the Triton-3.6 limits that held the prefill there (no warp specialisation,
no explicit shared memory, every wgmma waited at once) can be lifted without leaving the contract.

The contract's arithmetic is kept op for op (rlkernel/backends/triton/attention.py, session 25's TTGIR read on the
CPU): a 64-row tile = 16 tokens x the G = 4 query heads of one kv head; keys in 64-key chunks at absolute positions;
s = q.k^T as one wgmma m64n64 k16 chain from zero (the score layout NVMMA v3, 4 warps, instr 16x64x16: the row
reductions' order); m / alpha / p / l exactly as `_chunk` (exp2, fma, fp contraction off), p cast to bf16 and p.v as a
wgmma m64n128 chain onto acc * alpha; 512-key segments folded into (M, L, O) by `_merge` at each segment's first chunk,
out = div_rn(O, L). Scheduling knobs (none changes a row's arithmetic; the bit check says whether that holds):

  NCONS   query tiles per CTA (1 or 2): each is a consumer partition of 4 warps (one warpgroup) running the contract's
          64-row tile; with 2, adjacent tiles share one stream of K / V chunks (loaded once, released when both
          consumers are done with a stage);
  OSMEM   the segment accumulator O (64 x 128 fp32, 64 registers a thread) lives in shared memory, touched only at a
          segment fold and at the end (production's registers: 238 with it, 176-180 without it, session 25);
  PIPE    the next chunk's q.k^T wgmma is issued before this chunk's softmax (FA3's intra-warpgroup overlap);
  STAGES  K / V chunks in flight (one producer warp: TMA loads into an mbarrier ring).

    python3 scripts/gpu_gluon_attn.py --compile-only       # any machine: compile every variant for sm_90
    python3 scripts/gpu_gluon_attn.py --out DIR            # an H200: bits vs production, time vs production / SDPA

Writes DIR/h200_gluon_attn.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

T0 = time.time()
_LOG2E = 1.4426950408889634

# name -> knobs over DEFAULTS. OSMEM 1: O in unpadded shared memory (8-way bank conflicts on the wgmma layout's
# rows, found in call 3), 2: rows padded by 8 floats (two wavefronts per 64-bit access, the least). PIPE 2: ping-pong.
# NFULL: the causal mask only on chunks some row does not see in full (production's split; the uniform walk masks all).
# DIAG (timing only, other bits): 1 no softmax (p = s), 2 no q.k^T (s from registers), 3 no mask at all.
DEFAULTS = dict(NCONS=2, OSMEM=0, PIPE=0, STAGES=3, CONS_REGS=232, NFULL=0, DIAG=0)
VARIANTS = {
    "ws1": dict(NCONS=1, CONS_REGS=0),
    "ws1_osmem": dict(NCONS=1, CONS_REGS=0, OSMEM=1),
    "ws1_osmem_pipe": dict(NCONS=1, CONS_REGS=0, OSMEM=1, PIPE=1),
    "ws2": dict(),
    "ws2_s4": dict(STAGES=4),
    "ws2_osmem": dict(OSMEM=1),
    "ws2_osmem_pipe": dict(OSMEM=1, PIPE=1),
    "ws2_osmem_pipe_s2": dict(OSMEM=1, PIPE=1, STAGES=2),
    "ws2_osmem_pipe_s4": dict(OSMEM=1, PIPE=1, STAGES=4),
    "pp2": dict(PIPE=2),
    "pp2_s4": dict(PIPE=2, STAGES=4),
    "pp2_osmem_s4": dict(PIPE=2, STAGES=4, OSMEM=1),
    "pp2_opad_s4": dict(PIPE=2, STAGES=4, OSMEM=2),
    "pp2_nfull_s4": dict(PIPE=2, STAGES=4, NFULL=1),
    "diag_pp2_nosoftmax": dict(PIPE=2, STAGES=4, DIAG=1),
    "diag_pp2_noqk": dict(PIPE=2, STAGES=4, DIAG=2),
    "diag_pp2_nomask": dict(PIPE=2, STAGES=4, DIAG=3),
}
PRODUCER_REGS = gl.constexpr(24)  # the producer warp: TMA issue only (setmaxnreg gives the rest away)


@gluon.jit
def _merge(M, L, O, m, l, o, row_o: gl.constexpr):
    """attention._merge: (M, L, O) <- (M, L, O) (+) (m, l, o), the same ops in the same order."""
    M_new = gl.maximum(M, m)
    Ms = gl.where(M_new == float("-inf"), 0.0, M_new)
    a = gl.where(M_new == M, 1.0, gl.exp2(M - Ms))
    b = gl.where(M_new == m, 1.0, gl.exp2(m - Ms))
    L = gl.fma(L, a, l * b)
    ao = gl.convert_layout(a, row_o)
    bo = gl.convert_layout(b, row_o)
    O = gl.fma(O, ao[:, None], o * bo[:, None])
    return M_new, L, O


@gluon.jit
def _softmax_pv(s, m, l, acc, vbuf, kpos, qpos, qk_scale, row_o: gl.constexpr, p_layout: gl.constexpr):
    """attention._chunk after its q.k^T: the causal mask (an identity on chunks every row sees in full), m, alpha, p, l,
    acc * alpha, then p.v onto it (synchronous wgmma)."""
    s = gl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.where(m_new == m, 1.0, gl.exp2(m - m_safe))
    p = gl.exp2(gl.fma(s, qk_scale, -m_safe[:, None]))
    l = l * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), vbuf, acc)
    return m_new, l, acc


@gluon.jit
def _consumer(q_ptr, o_ptr, qs_ptr, ql_ptr, kl_ptr, q_smem, o_smem, bufs_k, bufs_v, ready, empty, sqt, sqh, sot, soh,
              qk_scale, pair, nc_cta, WHICH: gl.constexpr, NCONS: gl.constexpr, G: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, SEG_CHUNKS: gl.constexpr,
              OSMEM: gl.constexpr, PIPE: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    TOK: gl.constexpr = BLOCK_M // G
    S: gl.constexpr = bufs_k.type.shape[0]
    req = gl.program_id(1)
    kvh = gl.program_id(2)
    tile = pair * NCONS + WHICH
    q_len = gl.load(ql_ptr + req)
    q_start = gl.load(qs_ptr + req)
    kv_len = gl.load(kl_ptr + req)
    tok0 = tile * TOK
    first = kv_len - q_len
    n_chunks = 0
    if tok0 < q_len:
        n_chunks = (first + gl.minimum(tok0 + TOK, q_len) - 1) // BLOCK_N + 1
    # the query tile (rows: TOK tokens x G heads of kv head kvh) into shared memory, the wgmma's A operand
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
    tok = tok0 + r // G
    row_ok = (tok < q_len) & (r < TOK * G)
    qrow = (q_start + gl.minimum(tok, q_len - 1)).to(gl.int64)
    head = kvh * G + r % G
    q = gl.load(q_ptr + qrow[:, None] * sqt + head[:, None] * sqh + d[None, :], mask=row_ok[:, None], other=0.0)
    q_smem.store(q)
    fence_async_shared()
    rs = gl.arange(0, BLOCK_M, layout=row_s)
    qpos = first + gl.minimum(tok0 + rs // G, q_len - 1)
    kcol = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    M = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    L = gl.zeros([BLOCK_M], gl.float32, row_s)
    O = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    if OSMEM:
        o_smem.store(O)
    m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    if PIPE:
        # chunk c + 1's scores are issued (async) before chunk c's softmax; the synchronous p.v that ends chunk c
        # waits for them too (wgmma groups retire in order), by when the softmax has covered their time
        if n_chunks > 0:
            mbarrier.wait(ready.index(0), 0)
            s_tok = warpgroup_mma(q_smem, bufs_k.index(0).permute((1, 0)), zero_s, is_async=True)
            for c in range(0, n_chunks):
                st = c % S
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
                # issued on every chunk (past the last one it reads a stage's stale keys and is discarded): a
                # conditional issue would merge two in-flight accumulators at the loop's back edge, which ptxas
                # serialises (C7514)
                st1 = (c + 1) % S
                mbarrier.wait(ready.index(st1), ((c + 1) // S) & 1, pred=c + 1 < n_chunks)
                s_tok = warpgroup_mma(q_smem, bufs_k.index(st1).permute((1, 0)), zero_s, is_async=True)
                if ((c % SEG_CHUNKS) == 0) & (c > 0):
                    if OSMEM:
                        M, L, O = _merge(M, L, o_smem.load(o_layout), m, l, acc, row_o)
                        o_smem.store(O)
                    else:
                        M, L, O = _merge(M, L, O, m, l, acc, row_o)
                    m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                    l = gl.zeros([BLOCK_M], gl.float32, row_s)
                    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
                m, l, acc = _softmax_pv(s, m, l, acc, bufs_v.index(st), c * BLOCK_N + kcol, qpos, qk_scale, row_o,
                                        p_layout)
                mbarrier.arrive(empty.index(st), count=1)
            warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        for c in range(n_chunks, nc_cta):  # the other tile's last chunk: released unread
            st = c % S
            mbarrier.wait(ready.index(st), (c // S) & 1)
            mbarrier.arrive(empty.index(st), count=1)
    else:
        for c in range(0, nc_cta):
            st = c % S
            mbarrier.wait(ready.index(st), (c // S) & 1)
            if c < n_chunks:
                if ((c % SEG_CHUNKS) == 0) & (c > 0):
                    if OSMEM:
                        M, L, O = _merge(M, L, o_smem.load(o_layout), m, l, acc, row_o)
                        o_smem.store(O)
                    else:
                        M, L, O = _merge(M, L, O, m, l, acc, row_o)
                    m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                    l = gl.zeros([BLOCK_M], gl.float32, row_s)
                    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
                s = warpgroup_mma(q_smem, bufs_k.index(st).permute((1, 0)), zero_s)
                m, l, acc = _softmax_pv(s, m, l, acc, bufs_v.index(st), c * BLOCK_N + kcol, qpos, qk_scale, row_o,
                                        p_layout)
            mbarrier.arrive(empty.index(st), count=1)
    if OSMEM:
        O = o_smem.load(o_layout)
    M, L, O = _merge(M, L, O, m, l, acc, row_o)
    out = gl.div_rn(O, gl.convert_layout(L, row_o)[:, None])
    ro = gl.arange(0, BLOCK_M, layout=row_o)
    do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    tok_o = tok0 + ro // G
    ok_o = (tok_o < q_len) & (ro < TOK * G)
    qrow_o = (q_start + gl.minimum(tok_o, q_len - 1)).to(gl.int64)
    head_o = kvh * G + ro % G
    gl.store(o_ptr + qrow_o[:, None] * sot + head_o[:, None] * soh + do[None, :], out.to(gl.bfloat16),
             mask=ok_o[:, None])


@gluon.jit
def _consumer_pp(q_ptr, o_ptr, qs_ptr, ql_ptr, kl_ptr, q_smem, o_smem, bufs_k, bufs_v, ready, empty, turn, sqt, sqh,
                 sot, soh, qk_scale, pair, nc_cta, WHICH: gl.constexpr, G: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, D: gl.constexpr, SEG_CHUNKS: gl.constexpr, OSMEM: gl.constexpr,
                 NFULL: gl.constexpr, DIAG: gl.constexpr):
    """FA3's ping-pong for two consumer warpgroups: in its turn a warpgroup issues chunk c - 1's p.v and chunk c's
    q.k^T (both async), hands the turn over, waits for both and runs chunk c's softmax while the other warpgroup's
    tensor-core work runs. Every consumer walks the CTA's nc_cta chunks: a chunk past all of a tile's rows is an exact
    identity under the causal mask (p == 0, alpha == 1; a segment of such chunks merges as (-inf, 0, 0)), the
    contract's own property, so the lower tile needs no branch and the turns stay paired."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    TOK: gl.constexpr = BLOCK_M // G
    S: gl.constexpr = bufs_k.type.shape[0]
    req = gl.program_id(1)
    kvh = gl.program_id(2)
    tok0 = (pair * 2 + WHICH) * TOK
    q_len = gl.load(ql_ptr + req)
    q_start = gl.load(qs_ptr + req)
    kv_len = gl.load(kl_ptr + req)
    first = kv_len - q_len
    n_full = (first + tok0 + 1) // BLOCK_N  # chunks every row of the tile sees in full
    if nc_cta > 0:
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
        tok = tok0 + r // G
        row_ok = (tok < q_len) & (r < TOK * G)
        qrow = (q_start + gl.minimum(tok, q_len - 1)).to(gl.int64)
        head = kvh * G + r % G
        q = gl.load(q_ptr + qrow[:, None] * sqt + head[:, None] * sqh + d[None, :], mask=row_ok[:, None], other=0.0)
        q_smem.store(q)
        fence_async_shared()
        rs = gl.arange(0, BLOCK_M, layout=row_s)
        qpos = first + gl.minimum(tok0 + rs // G, q_len - 1)
        kcol = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        M = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        L = gl.zeros([BLOCK_M], gl.float32, row_s)
        O = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
        if OSMEM:
            o_smem.store(O)
        m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l = gl.zeros([BLOCK_M], gl.float32, row_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
        # chunk 0: q.k^T in the first turn (warpgroup 0 first: a fresh barrier passes parity 1)
        mbarrier.wait(ready.index(0), 0)
        mbarrier.wait(turn.index(WHICH), 1 - WHICH)
        s_tok = warpgroup_mma(q_smem, bufs_k.index(0).permute((1, 0)), zero_s, is_async=True)
        mbarrier.arrive(turn.index(1 - WHICH), count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        s = gl.where(kcol[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.where(m_new == m, 1.0, gl.exp2(m - m_safe))
        p32 = gl.exp2(gl.fma(s, qk_scale, -m_safe[:, None]))
        l = l * alpha + gl.sum(p32, 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p = gl.convert_layout(p32.to(gl.bfloat16), p_layout)
        m = m_new
        for c in range(1, nc_cta):
            st = c % S
            sp = (c - 1) % S
            mbarrier.wait(ready.index(st), (c // S) & 1)
            mbarrier.wait(turn.index(WHICH), (c & 1) ^ (1 - WHICH))
            acc_tok = warpgroup_mma(p, bufs_v.index(sp), acc, is_async=True)  # chunk c - 1's p.v
            if DIAG == 2:  # timing only: no q.k^T
                mbarrier.arrive(turn.index(1 - WHICH), count=1)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
                s = zero_s + c
            else:
                s_tok = warpgroup_mma(q_smem, bufs_k.index(st).permute((1, 0)), zero_s, is_async=True)
                mbarrier.arrive(turn.index(1 - WHICH), count=1)
                acc, s = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, s_tok))
            mbarrier.arrive(empty.index(sp), count=1)
            if (c % SEG_CHUNKS) == 0:  # chunk c opens a segment: fold the finished one (its last p.v is in acc)
                if OSMEM:
                    M, L, O = _merge(M, L, o_smem.load(o_layout), m, l, acc, row_o)
                    o_smem.store(O)
                else:
                    M, L, O = _merge(M, L, O, m, l, acc, row_o)
                m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                l = gl.zeros([BLOCK_M], gl.float32, row_s)
                acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
            if DIAG == 1:  # timing only: no softmax
                p = gl.convert_layout(s.to(gl.bfloat16), p_layout)
            else:
                if DIAG != 3:
                    if NFULL:
                        if c >= n_full:
                            s = gl.where((c * BLOCK_N + kcol)[None, :] <= qpos[:, None], s, float("-inf"))
                    else:
                        s = gl.where((c * BLOCK_N + kcol)[None, :] <= qpos[:, None], s, float("-inf"))
                m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.where(m_new == m, 1.0, gl.exp2(m - m_safe))
                p32 = gl.exp2(gl.fma(s, qk_scale, -m_safe[:, None]))
                l = l * alpha + gl.sum(p32, 1)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p = gl.convert_layout(p32.to(gl.bfloat16), p_layout)
                m = m_new
        sl = (nc_cta - 1) % S
        acc = warpgroup_mma(p, bufs_v.index(sl), acc)  # the last chunk's p.v
        mbarrier.arrive(empty.index(sl), count=1)
        if OSMEM:
            O = o_smem.load(o_layout)
        M, L, O = _merge(M, L, O, m, l, acc, row_o)
        out = gl.div_rn(O, gl.convert_layout(L, row_o)[:, None])
        ro = gl.arange(0, BLOCK_M, layout=row_o)
        do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        tok_o = tok0 + ro // G
        ok_o = (tok_o < q_len) & (ro < TOK * G)
        qrow_o = (q_start + gl.minimum(tok_o, q_len - 1)).to(gl.int64)
        head_o = kvh * G + ro % G
        gl.store(o_ptr + qrow_o[:, None] * sot + head_o[:, None] * soh + do[None, :], out.to(gl.bfloat16),
                 mask=ok_o[:, None])


@gluon.jit
def _producer(k_desc, v_desc, bufs_k, bufs_v, ready, empty, kv_start, kvh, nc_cta, BLOCK_N: gl.constexpr,
              D: gl.constexpr):
    """One warp: chunk c's K and V tiles into stage c % S once every consumer released its previous use."""
    S: gl.constexpr = bufs_k.type.shape[0]
    for c in range(0, nc_cta):
        st = c % S
        mbarrier.wait(empty.index(st), ((c // S) & 1) ^ 1)  # a fresh barrier counts as released once
        mbarrier.expect(ready.index(st), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_start + c * BLOCK_N, kvh * D], ready.index(st), bufs_k.index(st))
        tma.async_copy_global_to_shared(v_desc, [kv_start + c * BLOCK_N, kvh * D], ready.index(st), bufs_v.index(st))


@gluon.jit
def gluon_attn_kernel(q_ptr, o_ptr, k_desc, v_desc, qs_ptr, ql_ptr, kl_ptr, sqt, sqh, sot, soh, qk_scale, n_pairs,
                      G: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                      SEG_CHUNKS: gl.constexpr, STAGES: gl.constexpr, NCONS: gl.constexpr, OSMEM: gl.constexpr,
                      PIPE: gl.constexpr, CONS_REGS: gl.constexpr, NFULL: gl.constexpr, DIAG: gl.constexpr,
                      num_warps: gl.constexpr):
    """Grid (pairs of NCONS query tiles, longest first; requests; kv heads)."""
    TOK: gl.constexpr = BLOCK_M // G
    pair = n_pairs - 1 - gl.program_id(0)
    req = gl.program_id(1)
    kvh = gl.program_id(2)
    q_len = gl.load(ql_ptr + req)
    q_start = gl.load(qs_ptr + req)
    kv_len = gl.load(kl_ptr + req)
    first = kv_len - q_len
    nc_cta = 0
    if pair * NCONS * TOK < q_len:  # the CTA's last live tile sees the most chunks
        t_last = gl.minimum(pair * NCONS + NCONS - 1, (q_len - 1) // TOK)
        nc_cta = (first + gl.minimum(t_last * TOK + TOK, q_len) - 1) // BLOCK_N + 1
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
    bufs_k = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    bufs_v = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_all = gl.allocate_shared_memory(gl.bfloat16, [NCONS, BLOCK_M, D], q_layout)
    if OSMEM == 1:
        o_all = gl.allocate_shared_memory(gl.float32, [NCONS, BLOCK_M, D],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        o_0 = o_all.index(0)
        o_1 = o_all.index(NCONS - 1)
    elif OSMEM == 2:  # one buffer per consumer (a padded layout does not index along a leading dim here)
        pad: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[D, 8]], [BLOCK_M, D], [1, 0])
        o_0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D], pad)
        o_1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D], pad)
    else:  # unused
        o_0 = q_all.index(0)
        o_1 = q_all.index(NCONS - 1)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NCONS)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    kv_start = q_start  # packed: a request's keys are its own rows
    if PIPE == 2:
        gl.static_assert(NCONS == 2, "ping-pong takes two consumers")
        gl.warp_specialize([
            (_consumer_pp, (q_ptr, o_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(0), o_0, bufs_k, bufs_v, ready,
                            empty, turn, sqt, sqh, sot, soh, qk_scale, pair, nc_cta, 0, G, BLOCK_M, BLOCK_N, D,
                            SEG_CHUNKS, OSMEM, NFULL, DIAG)),
            (_producer, (k_desc, v_desc, bufs_k, bufs_v, ready, empty, kv_start, kvh, nc_cta, BLOCK_N, D)),
            (_consumer_pp, (q_ptr, o_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(1), o_1, bufs_k, bufs_v, ready,
                            empty, turn, sqt, sqh, sot, soh, qk_scale, pair, nc_cta, 1, G, BLOCK_M, BLOCK_N, D,
                            SEG_CHUNKS, OSMEM, NFULL, DIAG)),
        ], [1, 4], [PRODUCER_REGS, CONS_REGS])
    elif NCONS == 2:
        gl.warp_specialize([
            (_consumer, (q_ptr, o_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(0), o_0, bufs_k, bufs_v, ready,
                         empty, sqt, sqh, sot, soh, qk_scale, pair, nc_cta, 0, NCONS, G, BLOCK_M, BLOCK_N, D,
                         SEG_CHUNKS, OSMEM, PIPE)),
            (_producer, (k_desc, v_desc, bufs_k, bufs_v, ready, empty, kv_start, kvh, nc_cta, BLOCK_N, D)),
            (_consumer, (q_ptr, o_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(1), o_1, bufs_k, bufs_v, ready,
                         empty, sqt, sqh, sot, soh, qk_scale, pair, nc_cta, 1, NCONS, G, BLOCK_M, BLOCK_N, D,
                         SEG_CHUNKS, OSMEM, PIPE)),
        ], [1, 4], [PRODUCER_REGS, CONS_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_ptr, o_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(0), o_0, bufs_k, bufs_v, ready,
                         empty, sqt, sqh, sot, soh, qk_scale, pair, nc_cta, 0, NCONS, G, BLOCK_M, BLOCK_N, D,
                         SEG_CHUNKS, OSMEM, PIPE)),
            (_producer, (k_desc, v_desc, bufs_k, bufs_v, ready, empty, kv_start, kvh, nc_cta, BLOCK_N, D)),
        ], [1], [PRODUCER_REGS])


def _kv_layout(block_n, d):
    return gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)


def _constexprs(variant, G=4, block_m=64, block_n=64, d=128, seg_keys=512):
    return dict(G=G, BLOCK_M=block_m, BLOCK_N=block_n, D=d, SEG_CHUNKS=seg_keys // block_n,
                **{**DEFAULTS, **VARIANTS[variant]}, num_warps=4)



def compile_sm90(variant):
    """Compile a variant for sm_90 here (no GPU needed): the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    const = _constexprs(variant)
    lay = _kv_layout(const["BLOCK_N"], const["D"])
    desc = f"tensordesc<bf16[{const['BLOCK_N']}, {const['D']}],{lay!r}>"
    sig = {"q_ptr": "*bf16", "o_ptr": "*bf16", "k_desc": desc, "v_desc": desc, "qs_ptr": "*i32", "ql_ptr": "*i32",
           "kl_ptr": "*i32", "sqt": "i32", "sqh": "i32", "sot": "i32", "soh": "i32", "qk_scale": "fp32",
           "n_pairs": "i32", **{k: "constexpr" for k in const}}
    src = GluonASTSource(gluon_attn_kernel, sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})


def ptxas_usage(ptx: str) -> str:
    """ptxas -v's register / spill / shared-memory line for the kernel (Triton's bundled ptxas; no GPU needed)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                           capture_output=True, text=True)
    lines = [ln.split("info    : ")[-1] for ln in (r.stdout + r.stderr).splitlines() if re.search(r"registers|spill", ln)]
    return " | ".join(lines)


def ptx_facts(kernel) -> dict:
    import re
    ptx = kernel.asm["ptx"]
    return {"setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx))),
            "ptxas": ptxas_usage(ptx),
            "wgmma_shapes": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            "tma_loads": ptx.count("cp.async.bulk.tensor"), "fma_rn": ptx.count("fma.rn.f32"),
            "shared_bytes": kernel.metadata.shared, "warps": kernel.metadata.num_warps}


def gluon_attention(q, k, v, cu, max_seqlen, variant, scale=None):
    """Packed varlen causal attention: q [T, Hq, D], k / v [T, Hkv, D] bf16, cu_seqlens [B + 1] (int32, CUDA)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    T, hq, d = q.shape
    hkv = k.shape[1]
    const = _constexprs(variant, G=hq // hkv, d=d)
    tok = const["BLOCK_M"] // const["G"]
    n_pairs = triton.cdiv(triton.cdiv(max_seqlen, tok), const["NCONS"])
    q_start = cu[:-1].contiguous()
    q_len = (cu[1:] - cu[:-1]).contiguous()
    out = torch.empty_like(q)
    lay = _kv_layout(const["BLOCK_N"], d)
    k2 = k.view(T, hkv * d)
    v2 = v.view(T, hkv * d)
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [const["BLOCK_N"], d], lay)
    vd = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [const["BLOCK_N"], d], lay)
    qk_scale = float(d ** -0.5 if scale is None else scale) * _LOG2E
    gluon_attn_kernel[(n_pairs, q_len.shape[0], hkv)](
        q, out, kd, vd, q_start, q_len, q_len, q.stride(0), q.stride(1), out.stride(0), out.stride(1), qk_scale,
        n_pairs, enable_fp_fusion=False, **const)
    return out


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    res = {"triton": triton.__version__, "compiled_sm90": {}}
    for name in names:
        try:
            res["compiled_sm90"][name] = ptx_facts(compile_sm90(name))
        except Exception as e:  # noqa: BLE001 -- a variant this Triton cannot build is recorded
            res["compiled_sm90"][name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        log(name, json.dumps(res["compiled_sm90"][name]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compile_only:
        return 0 if all("error" not in v for v in res["compiled_sm90"].values()) else 1
    import torch
    if not torch.cuda.is_available():
        res["skipped"] = "no CUDA device"
        (out / "h200_gluon_attn.json").write_text(json.dumps(res, indent=1) + "\n")
        return 0
    import torch.nn.functional as F
    from triton.testing import do_bench
    from rlkernel.backends.triton import attention as A

    torch.manual_seed(0)
    res.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
               timer="triton.testing.do_bench (L2 flushed), median ms; TFLOP/s = causal FLOPs 2*2*B*Hq*L*L*D/2",
               cases={})

    def bench(fn):
        return do_bench(fn, warmup=10, rep=60)

    cases = {"q8b_8x4096": ([4096] * 8, 32, 8, 128),
             "q8b_varlen_bits": ([4096, 77, 1000, 2049, 513, 511, 3333, 1, 16, 17, 64, 65], 32, 8, 128),
             "q8b_4x1024": ([1024] * 4, 32, 8, 128),
             "q06_8x4096": ([4096] * 8, 16, 8, 128)}
    for cname, (lens, hq, hkv, d) in cases.items():
        T, L = sum(lens), max(lens)
        q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        flops = sum(4 * hq * n * n * d / 2 for n in lens)
        timed = cname != "q8b_varlen_bits"
        row = res["cases"][cname] = {"lengths": lens, "hq": hq, "hkv": hkv, "d": d, "variants": {}}
        ref = A.attention_varlen(q, k, v, cu, max_seqlen=L, split=False)
        ref_split = A.attention_varlen(q, k, v, cu, max_seqlen=L, split=True)
        row["production_split_equal"] = bool(torch.equal(ref, ref_split))
        if timed:
            t = bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L))
            row["production_ms"], row["production_tflops"] = round(t, 4), round(flops / t / 1e9, 1)
            if len(set(lens)) == 1:
                B = len(lens)
                qb, kb, vb = (x.view(B, L, -1, d).transpose(1, 2) for x in (q, k, v))
                t = bench(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True))
                row["sdpa_ms"], row["sdpa_tflops"] = round(t, 4), round(flops / t / 1e9, 1)
                row["production_vs_sdpa"] = round(row["sdpa_ms"] / row["production_ms"], 3)
        log(cname, {kk: vv for kk, vv in row.items() if kk != "variants"})
        for name in names:
            rec = row["variants"][name] = {}
            if "error" in res["compiled_sm90"].get(name, {}):
                rec["error"] = "did not compile"
                continue
            try:
                y = gluon_attention(q, k, v, cu, L, name)
                torch.cuda.synchronize()
                rec["equal_production"] = bool(torch.equal(y, ref))
                if not rec["equal_production"]:
                    diff = (y.float() - ref.float()).abs()
                    rec["rows_differ"] = int((diff.amax(dim=(1, 2)) > 0).sum())
                    rec["max_abs_diff"] = float(diff.max())
                    rec["nan"] = bool(torch.isnan(y).any())
                rec["run_to_run_equal"] = bool(torch.equal(y, gluon_attention(q, k, v, cu, L, name)))
                if timed:
                    t = bench(lambda: gluon_attention(q, k, v, cu, L, name))
                    rec["ms"], rec["tflops"] = round(t, 4), round(flops / t / 1e9, 1)
                    rec["vs_production"] = round(row["production_ms"] / t, 3)
                    if "sdpa_ms" in row:
                        rec["vs_sdpa"] = round(row["sdpa_ms"] / t, 3)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(cname, name, rec)
            (out / "h200_gluon_attn.json").write_text(json.dumps(res, indent=1) + "\n")
        del q, k, v
        torch.cuda.empty_cache()
    res["seconds"] = round(time.time() - T0, 1)
    (out / "h200_gluon_attn.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""PAIR: the Gluon prefill (attention_gluon) with two 64-key chunks a turn — an experiment, not yet the library's.

The same ops in the same order as `attention_gluon._prefill_kernel` (and so `attention._attn_fwd`): the contract's
64-key chunks, each chunk's row max, alpha, p and l by `_stats`, p.v onto acc * alpha, 512-key segments folded by
`_merge`. What changes is the schedule:
* K and V come in 128-key stages (TMA boxes of [128, D]); a turn issues q.k^T of two chunks as one m64n128 k16 chain
  (session 34 measured the m64n64 chain at ~0.62x the m64n128 rate per FLOP: it reads 4 KB of shared memory a k-step
  for 131 kFLOP). Each score is the same k16 chain over D whatever N is, so the same bits (checked on the GPU);
* the turn issues the previous pair's first p.v, then the q.k^T, waits for the p.v alone (the q.k^T keeps the tensor
  cores busy), applies the second chunk's rescale (acc * alpha: the contract's order puts it between the two p.v),
  issues the second p.v and hands the turn on;
* the softmax then runs both chunks' row reductions and exp2s, independent until the running max meets, so the two
  chains overlap (session 33's counters: the one-chunk chain is latency-bound, ~0.22 instructions a cycle a warp).
A CTA with an odd chunk count walks one more chunk past every row: an exact identity under the causal mask (p == 0,
alpha == 1), the contract's own property that the two-tile walk already relies on. The scores of the pair are split
into the chunks' [64, 64] score layout without moving a register (`convert_layout(..., assert_trivial=True)`), so the
row reductions run in the Triton kernel's order.

Knobs (compile-time; `launch`'s keywords): STAGES (pair stages in flight: 2 = 128 KB, 3 = 192 KB), OVL (1: the
softmax's row stats run while the turn's second p.v still runs; 0: after it), HAND (0: the turn is handed on after
the second p.v's issue; 1: right after the q.k^T's issue), TREE (the row max by `_rowmax_tree`: the same values).
"""
from __future__ import annotations

from . import attention_gluon as AG
from .gluon_checks import descriptor
from .launch import fast

STAGES = 2
OVL = 0
HAND = 0
PAIR_KEYS = 128
_LAYOUTS: dict = {}

if AG._IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    from .attention_gluon_parts import _load_q, _mask, _merge, _softmax, _stats, _store_lse, _tile_rows

    @gluon.jit
    def _halves(s2, s_layout: gl.constexpr):
        """A pair's [BM, 128] scores as the two chunks' [BM, 64] in the chunk score layout, register for register."""
        BM: gl.constexpr = s2.type.shape[0]
        BN: gl.constexpr = s2.type.shape[1] // 2
        a, b = gl.split(gl.permute(gl.reshape(s2, [BM, 2, BN]), (0, 2, 1)))
        return gl.convert_layout(a, s_layout, assert_trivial=True), gl.convert_layout(b, s_layout, assert_trivial=True)

    @gluon.jit
    def _pair_consumer(q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_smem, bufs_k, bufs_v, ready, empty, turn, sqt,
                       sqh, sot, soh, hq, qk_scale, pair, req, kvh, nc_cta, WHICH: gl.constexpr, G: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, SEG_CHUNKS: gl.constexpr,
                       STORE_LSE: gl.constexpr, OVL: gl.constexpr, HAND: gl.constexpr, TREE: gl.constexpr):
        """One query tile, ping-ponged with the other a pair of chunks a turn (module docstring)."""
        gl.static_assert(SEG_CHUNKS % 2 == 0, "a segment opens at an even chunk: the first of a pair")
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        s2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, 2 * BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        TOK: gl.constexpr = BLOCK_M // G
        S: gl.constexpr = bufs_k.type.shape[0]
        tok0 = (pair * 2 + WHICH) * TOK
        FIRST: gl.constexpr = 1 if WHICH == 0 else 0  # consumer 0 opens: a fresh barrier passes parity 1
        NEXT: gl.constexpr = 1 - WHICH
        q_len, q_start, first, n_full = _tile_rows(ql_ptr, qs_ptr, kl_ptr, req, tok0, BLOCK_N)
        if nc_cta > 0:
            n_pairs = (nc_cta + 1) // 2
            qrow, head, row_ok, d = _load_q(q_ptr, q_smem, q_start, q_len, kvh, tok0, sqt, sqh, G, BLOCK_M, D, ld_layout)
            rs = gl.arange(0, BLOCK_M, layout=row_s)
            qpos = first + gl.minimum(tok0 + rs // G, q_len - 1)
            kcol = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            zero_s2 = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, s2_layout)
            M = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
            L = gl.zeros([BLOCK_M], gl.float32, row_s)
            O = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
            m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
            l = gl.zeros([BLOCK_M], gl.float32, row_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
            # pair 0 (chunks 0 and 1): q.k^T in the first turn
            mbarrier.wait(ready.index(0), 0)
            mbarrier.wait(turn.index(WHICH), FIRST)
            s2_tok = warpgroup_mma(q_smem, bufs_k.index(0).permute((1, 0)), zero_s2, is_async=True)
            mbarrier.arrive(turn.index(NEXT), count=1)
            s2 = warpgroup_mma_wait(num_outstanding=0, deps=(s2_tok,))
            s_a, s_b = _halves(s2, s_layout)
            s_a = gl.where(kcol[None, :] <= qpos[:, None], s_a, float("-inf"))
            m, l, acc, p_a = _softmax(s_a, m, l, acc, qk_scale, row_o, p_layout, 2 * TREE)
            s_b = _mask(s_b, 1, n_full, kcol, qpos, BLOCK_N, 1)
            m, alpha_b, l, p_b = _stats(s_b, m, l, qk_scale, p_layout, TREE)
            for j in range(1, n_pairs):
                st = j % S
                sp = (j - 1) % S
                v_prev = bufs_v.index(sp)
                mbarrier.wait(ready.index(st), (j // S) & 1)
                mbarrier.wait(turn.index(WHICH), (j & 1) ^ FIRST)
                a_tok = warpgroup_mma(p_a, v_prev.slice(0, BLOCK_N), acc, is_async=True)  # chunk 2j - 2's p.v
                s2_tok = warpgroup_mma(q_smem, bufs_k.index(st).permute((1, 0)), zero_s2, is_async=True)
                if HAND:
                    mbarrier.arrive(turn.index(NEXT), count=1)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(a_tok,))
                acc = acc * gl.convert_layout(alpha_b, row_o)[:, None]  # chunk 2j - 1's rescale (never a segment's first)
                b_tok = warpgroup_mma(p_b, v_prev.slice(BLOCK_N, BLOCK_N), acc, is_async=True)  # chunk 2j - 1's p.v
                if not HAND:
                    mbarrier.arrive(turn.index(NEXT), count=1)
                c = 2 * j
                if OVL:
                    s2 = warpgroup_mma_wait(num_outstanding=1, deps=(s2_tok,))
                    s_a, s_b = _halves(s2, s_layout)
                    s_a = _mask(s_a, c, n_full, kcol, qpos, BLOCK_N, 1)
                    s_b = _mask(s_b, c + 1, n_full, kcol, qpos, BLOCK_N, 1)
                    if (c % SEG_CHUNKS) == 0:  # chunk c opens a segment: its stats start afresh
                        m_in = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                        l_in = gl.zeros([BLOCK_M], gl.float32, row_s)
                    else:
                        m_in = m
                        l_in = l
                    m_a, alpha_a, l_a, pn_a = _stats(s_a, m_in, l_in, qk_scale, p_layout, TREE)
                    m_b, alpha_nb, l_b, pn_b = _stats(s_b, m_a, l_a, qk_scale, p_layout, TREE)
                    acc, p_b, pn_a, pn_b, alpha_a, alpha_nb, m_b, l_b = warpgroup_mma_wait(
                        num_outstanding=0, deps=(b_tok, p_b, pn_a, pn_b, alpha_a, alpha_nb, m_b, l_b))
                    mbarrier.arrive(empty.index(sp), count=1)
                    if (c % SEG_CHUNKS) == 0:  # fold the finished segment (its last p.v is in acc)
                        M, L, O = _merge(M, L, O, m, l, acc, row_o)
                        acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)  # (acc * alpha of zeros: zeros)
                    else:
                        acc = acc * gl.convert_layout(alpha_a, row_o)[:, None]
                    m = m_b
                    l = l_b
                    alpha_b = alpha_nb
                    p_a = pn_a
                    p_b = pn_b
                else:
                    acc, s2 = warpgroup_mma_wait(num_outstanding=0, deps=(b_tok, s2_tok))
                    mbarrier.arrive(empty.index(sp), count=1)
                    if (c % SEG_CHUNKS) == 0:  # chunk c opens a segment: fold the finished one (its last p.v is in acc)
                        M, L, O = _merge(M, L, O, m, l, acc, row_o)
                        m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                        l = gl.zeros([BLOCK_M], gl.float32, row_s)
                        acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
                    s_a, s_b = _halves(s2, s_layout)
                    s_a = _mask(s_a, c, n_full, kcol, qpos, BLOCK_N, 1)
                    m, l, acc, p_a = _softmax(s_a, m, l, acc, qk_scale, row_o, p_layout, 2 * TREE)
                    s_b = _mask(s_b, c + 1, n_full, kcol, qpos, BLOCK_N, 1)
                    m, alpha_b, l, p_b = _stats(s_b, m, l, qk_scale, p_layout, TREE)
            sl = (n_pairs - 1) % S
            acc = warpgroup_mma(p_a, bufs_v.index(sl).slice(0, BLOCK_N), acc)  # the last pair's p.v
            acc = acc * gl.convert_layout(alpha_b, row_o)[:, None]
            acc = warpgroup_mma(p_b, bufs_v.index(sl).slice(BLOCK_N, BLOCK_N), acc)
            mbarrier.arrive(empty.index(sl), count=1)
            M, L, O = _merge(M, L, O, m, l, acc, row_o)
            out = gl.div_rn(O, gl.convert_layout(L, row_o)[:, None])
            gl.store(o_ptr + qrow[:, None] * sot + head[:, None] * soh + d[None, :],
                     gl.convert_layout(out.to(o_ptr.dtype.element_ty), ld_layout), mask=row_ok[:, None])
            if STORE_LSE:
                _store_lse(lse_ptr, M, L, rs, tok0, q_start, q_len, kvh, hq, G, BLOCK_M)

    @gluon.jit
    def _pair_producer(k_desc, v_desc, bufs_k, bufs_v, ready, empty, kv_start, kvh, nc_cta, D: gl.constexpr):
        """One warp: pair j's K and V tiles (128 keys) into stage j % S once both consumers released its previous use
        (an odd chunk count's last pair reads 64 keys past the walk: masked, or zero-filled past the tensor)."""
        S: gl.constexpr = bufs_k.type.shape[0]
        BK: gl.constexpr = bufs_k.type.shape[1]
        for j in range(0, (nc_cta + 1) // 2):
            st = j % S
            mbarrier.wait(empty.index(st), ((j // S) & 1) ^ 1)  # a fresh barrier counts as released once
            mbarrier.expect(ready.index(st), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_start + j * BK, kvh * D], ready.index(st), bufs_k.index(st))
            tma.async_copy_global_to_shared(v_desc, [kv_start + j * BK, kvh * D], ready.index(st), bufs_v.index(st))

    @gluon.jit
    def _prefill_pair_kernel(q_ptr, o_ptr, lse_ptr, k_desc, v_desc, qs_ptr, ql_ptr, kl_ptr, ks_ptr, sqt, sqh, sot, soh,
                             qk_scale, n_pairs, G: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             D: gl.constexpr, SEG_CHUNKS: gl.constexpr, STAGES: gl.constexpr, STORE_LSE: gl.constexpr,
                             OVL: gl.constexpr, HAND: gl.constexpr, TREE: gl.constexpr, num_warps: gl.constexpr):
        """Grid as `_prefill_kernel`'s (pairs of query tiles, latest first; requests; kv heads)."""
        pair, req, kvh, kv_start, nc_cta, hq = AG._cta(n_pairs, ql_ptr, kl_ptr, ks_ptr, G, BLOCK_M, BLOCK_N)
        bufs_k, bufs_v, q_all, ready, empty, turn = AG._shared(k_desc, v_desc, STAGES, BLOCK_M, D)
        gl.warp_specialize([
            (_pair_consumer, (q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(0), bufs_k, bufs_v, ready, empty,
                              turn, sqt, sqh, sot, soh, hq, qk_scale, pair, req, kvh, nc_cta, 0, G, BLOCK_M, BLOCK_N, D,
                              SEG_CHUNKS, STORE_LSE, OVL, HAND, TREE)),
            (_pair_producer, (k_desc, v_desc, bufs_k, bufs_v, ready, empty, kv_start, kvh, nc_cta, D)),
            (_pair_consumer, (q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(1), bufs_k, bufs_v, ready, empty,
                              turn, sqt, sqh, sot, soh, hq, qk_scale, pair, req, kvh, nc_cta, 1, G, BLOCK_M, BLOCK_N, D,
                              SEG_CHUNKS, STORE_LSE, OVL, HAND, TREE)),
        ], [1, 4], [AG._PRODUCER_REGS, AG._CONSUMER_REGS])

    _pair_fast = fast(_prefill_pair_kernel)


def kv_layout(d: int):
    """The [128, d] K / V pair stage's shared layout (Triton's default for that shape), made once per d."""
    lay = _LAYOUTS.get(d)
    if lay is None:
        lay = _LAYOUTS[d] = gl.NVMMASharedLayout.get_default_for([PAIR_KEYS, d], gl.bfloat16)
    return lay


def launch(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt, lse=None, *, stages=STAGES,
           ovl=OVL, hand=HAND, tree=0):
    """`attention_gluon.launch`'s arguments on the pair kernel (sm_90, bf16, head dim 128, the contract's 64 x 64
    tiles and 512-key segments: the caller checks `attention_gluon.unsupported_reason`)."""
    rows, hkv, d = k.shape
    assert cfg.block_n * 2 == PAIR_KEYS and (cfg.seg_keys // cfg.block_n) % 2 == 0
    lay = kv_layout(d)
    shape, strides, block = [rows, hkv * d], [skt, 1], [PAIR_KEYS, d]
    k_desc, v_desc = descriptor(k, shape, strides, block, lay), descriptor(v, shape, strides, block, lay)
    n_pairs = -(-n_tiles // 2)
    _pair_fast[(n_pairs, q_len.shape[0], hkv)](
        q, out, lse if lse is not None else out, k_desc, v_desc, q_start, q_len, kv_len, kv_start,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), float(scale) * AG._LOG2E, n_pairs,
        G=q.shape[1] // hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d, SEG_CHUNKS=cfg.seg_keys // cfg.block_n,
        STAGES=stages, STORE_LSE=lse is not None, OVL=ovl, HAND=hand, TREE=tree, num_warps=4, enable_fp_fusion=False)
    return out

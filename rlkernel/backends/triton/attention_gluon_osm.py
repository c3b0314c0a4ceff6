"""`_prefill3_kernel`'s OWS 2 (session 38; attention_gluon): each consumer's finished segments' O in its own shared
tile, K and V in rings of their own so that three consumers' query and O tiles fit beside them; OWS 3 (session 40):
the same with the fold after the turn's q.k^T, O in column halves. Its device pieces: the shared memory and barriers,
the producer over the two rings, the folds and the consumer."""
from __future__ import annotations

try:  # as attention_gluon's: where Gluon does not import, nothing here is defined and that module says why
    from triton.experimental import gluon
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon import language as gl
    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

if _IMPORT_ERROR is None:
    from .attention_gluon_parts import (_load_q, _mask, _merge_stats, _qk_turn, _softmax, _store_lse, _store_out,
                                        _tile_rows)

    @gluon.jit
    def _shared_split(k_desc, v_desc, KSTAGES: gl.constexpr, VSTAGES: gl.constexpr, NCONS: gl.constexpr,
                      BLOCK_M: gl.constexpr, D: gl.constexpr, OPARTS: gl.constexpr = 1):
        """`_shared` with K and V in rings of their own (KSTAGES, VSTAGES: a K stage is free once every consumer's
        q.k^T read it, a turn before its V stage) and each consumer's finished segments' O (fp32) in shared memory:
        consumer i's tile is o_all[i] (OPARTS 1), or its column halves o_all[2 i], o_all[2 i + 1] (OPARTS 2)."""
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
        o_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D // OPARTS], gl.float32)
        bufs_k = gl.allocate_shared_memory(k_desc.dtype, [KSTAGES] + k_desc.block_type.shape, k_desc.layout)
        bufs_v = gl.allocate_shared_memory(v_desc.dtype, [VSTAGES] + v_desc.block_type.shape, v_desc.layout)
        q_all = gl.allocate_shared_memory(gl.bfloat16, [NCONS, BLOCK_M, D], q_layout)
        o_all = gl.allocate_shared_memory(gl.float32, [NCONS * OPARTS, BLOCK_M, D // OPARTS], o_smem_layout)
        bars = gl.allocate_shared_memory(gl.int64, [2 * KSTAGES + 2 * VSTAGES + NCONS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(KSTAGES + VSTAGES):
            mbarrier.init(bars.index(i), count=1)  # ready: K stages, then V stages
            mbarrier.init(bars.index(KSTAGES + VSTAGES + i), count=NCONS)  # empty: likewise
        for i in gl.static_range(NCONS):
            mbarrier.init(bars.index(2 * (KSTAGES + VSTAGES) + i), count=1)  # the turns
        return bufs_k, bufs_v, q_all, o_all, bars

    @gluon.jit
    def _producer_split(k_desc, v_desc, bufs_k, bufs_v, bars, kv_start, kvh, nc_cta, BLOCK_N: gl.constexpr,
                        D: gl.constexpr):
        """`_producer` over `_shared_split`'s two rings: chunk c's K once its K stage is free, then its V once its V
        stage is (V is read a turn after K: its ring may be the shorter)."""
        SK: gl.constexpr = bufs_k.type.shape[0]
        SV: gl.constexpr = bufs_v.type.shape[0]
        for c in range(0, nc_cta):
            sk = c % SK
            sv = c % SV
            mbarrier.wait(bars.index(SK + SV + sk), ((c // SK) & 1) ^ 1)  # a fresh barrier counts as released once
            mbarrier.expect(bars.index(sk), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_start + c * BLOCK_N, kvh * D], bars.index(sk), bufs_k.index(sk))
            mbarrier.wait(bars.index(SK + SV + SK + sv), ((c // SV) & 1) ^ 1)
            mbarrier.expect(bars.index(SK + sv), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [kv_start + c * BLOCK_N, kvh * D], bars.index(SK + sv), bufs_v.index(sv))

    @gluon.jit
    def _fold_smem(M, L, m, l, acc, o_smem, have_o, row_o: gl.constexpr, o_layout: gl.constexpr):
        """`_merge` with O in shared memory (`_consumer_osm`), in the accumulator's own layout: the same ops."""
        M_new, L, a, b = _merge_stats(M, L, m, l)
        t = acc * gl.convert_layout(b, row_o)[:, None]
        if have_o:
            O = o_smem.load(o_layout)
        else:
            O = gl.zeros(acc.shape, gl.float32, o_layout)
        return M_new, L, gl.fma(O, gl.convert_layout(a, row_o)[:, None], t)

    @gluon.jit
    def _halves(x, h_layout: gl.constexpr):
        """x [R, C]'s column halves [R, C / 2] in h_layout (the accumulator's NVMMA layout at half its width: the same
        registers, so no data moves)."""
        R: gl.constexpr = x.shape[0]
        C: gl.constexpr = x.shape[1]
        x0, x1 = gl.split(gl.permute(gl.reshape(x, [R, 2, C // 2]), (0, 2, 1)))
        return gl.convert_layout(x0, h_layout), gl.convert_layout(x1, h_layout)

    @gluon.jit
    def _fold_halves(M, L, m, l, acc, o_all, i0, have_o, row_o: gl.constexpr, h_layout: gl.constexpr,
                     STORE: gl.constexpr):
        """`_fold_smem` over O's two column halves o_all[i0], o_all[i0 + 1] (FOLD 1): each half loaded, folded and
        (STORE) stored back before the next, so that a fold needs 32 registers of O, not 64 — what lets the fold run
        with chunk c's scores live. The same ops on each element. Returns (M, L, O's halves)."""
        M_new, L, a, b = _merge_stats(M, L, m, l)
        t0, t1 = _halves(acc * gl.convert_layout(b, row_o)[:, None], h_layout)
        a_h = gl.convert_layout(a, gl.SliceLayout(1, h_layout))[:, None]
        if have_o:
            O0 = gl.fma(o_all.index(i0).load(h_layout), a_h, t0)
        else:
            O0 = gl.fma(gl.zeros(t0.shape, gl.float32, h_layout), a_h, t0)
        if STORE:
            o_all.index(i0).store(O0)
        if have_o:
            O1 = gl.fma(o_all.index(i0 + 1).load(h_layout), a_h, t1)
        else:
            O1 = gl.fma(gl.zeros(t1.shape, gl.float32, h_layout), a_h, t1)
        if STORE:
            o_all.index(i0 + 1).store(O1)
        return M_new, L, O0, O1

    @gluon.jit
    def _consumer_osm(q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_smem, o_smem, bufs_k, bufs_v, bars, sqt, sqh,
                      sot, soh, hq, qk_scale, grp, req, kvh, nc_cta, WHICH: gl.constexpr, G: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, SEG_CHUNKS: gl.constexpr,
                      STORE_LSE: gl.constexpr, NFULL: gl.constexpr, FOLD: gl.constexpr = 0, DIAG: gl.constexpr = 0):
        """`_consumer`'s OWS turn for `_prefill3_kernel`'s OWS 2 / 3: the finished segments' O in this consumer's
        shared tile (`o_smem` is `_shared_split`'s o_all: no slot, no lock), K and V from `_shared_split`'s rings — a
        K stage released as soon as this consumer's q.k^T read it, a V stage once its p.v did. The output tile goes
        out through `q_smem` (no longer read) in 16-byte stores, as production's. The same ops on the same values in
        the same order.
        FOLD 0 (OWS 2): a segment's first chunk folds between its p.v's wait and its q.k^T, which it then waits on
        alone (S is never live beside acc and O). FOLD 1 (OWS 3): that turn is any turn's — q.k^T issued behind the
        p.v and the turn handed on — and the fold runs after both waits, beside the other consumers' tensor-core work,
        as the two-consumer kernel's does; O in column halves (`_fold_halves`) keeps it under the registers.
        DIAG 3 (measurement only, other bits; never set by the library): no segment folds — these rings and this
        shared memory without the folds' work, beside `_consumer`'s DIAG 3."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        NCONS: gl.constexpr = 3
        TOK: gl.constexpr = BLOCK_M // G
        SK: gl.constexpr = bufs_k.type.shape[0]
        SV: gl.constexpr = bufs_v.type.shape[0]
        RK: gl.constexpr = 0  # bars: ready K, ready V, empty K, empty V, turns
        RV: gl.constexpr = SK
        EK: gl.constexpr = SK + SV
        EV: gl.constexpr = 2 * SK + SV
        TURN: gl.constexpr = 2 * (SK + SV)
        h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D // 2, 16])
        tok0 = (grp * NCONS + WHICH) * TOK
        FIRST: gl.constexpr = 1 if WHICH == 0 else 0  # consumer 0 opens: a fresh barrier passes parity 1
        NEXT: gl.constexpr = (WHICH + 1) % NCONS
        q_len, q_start, first, n_full = _tile_rows(ql_ptr, qs_ptr, kl_ptr, req, tok0, BLOCK_N)
        if nc_cta > 0:
            qrow, head, row_ok, d = _load_q(q_ptr, q_smem, q_start, q_len, kvh, tok0, sqt, sqh, G, BLOCK_M, D, ld_layout)
            rs = gl.arange(0, BLOCK_M, layout=row_s)
            qpos = first + gl.minimum(tok0 + rs // G, q_len - 1)
            kcol = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
            M = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
            L = gl.zeros([BLOCK_M], gl.float32, row_s)
            m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
            l = gl.zeros([BLOCK_M], gl.float32, row_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
            # chunk 0: q.k^T in the first turn (consumer 0 first: a fresh barrier passes parity 1)
            mbarrier.wait(bars.index(RK), 0)
            mbarrier.wait(bars.index(TURN + WHICH), FIRST)
            s_tok = warpgroup_mma(q_smem, bufs_k.index(0).permute((1, 0)), zero_s, is_async=True)
            mbarrier.arrive(bars.index(TURN + NEXT), count=1)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            mbarrier.arrive(bars.index(EK), count=1)
            s = gl.where(kcol[None, :] <= qpos[:, None], s, float("-inf"))
            m, l, acc, p = _softmax(s, m, l, acc, qk_scale, row_o, p_layout, 0)
            for c in range(1, nc_cta):
                sk = c % SK
                sv = (c - 1) % SV
                mbarrier.wait(bars.index(RK + sk), (c // SK) & 1)
                mbarrier.wait(bars.index(RV + sv), ((c - 1) // SV) & 1)
                mbarrier.wait(bars.index(TURN + WHICH), (c & 1) ^ FIRST)
                acc_tok = warpgroup_mma(p, bufs_v.index(sv), acc, is_async=True)  # chunk c - 1's p.v
                if FOLD:
                    acc, s = _qk_turn(q_smem, bufs_k.index(sk), zero_s, bars.index(TURN + NEXT), acc_tok)
                    mbarrier.arrive(bars.index(EV + sv), count=1)
                    if (c % SEG_CHUNKS) == 0 and DIAG != 3:  # chunk c opens a segment: fold the finished one
                        # the first fold (c == SEG_CHUNKS) finds O = 0, as the registers' version does
                        M, L, O0, O1 = _fold_halves(M, L, m, l, acc, o_smem, 2 * WHICH, c > SEG_CHUNKS, row_o,
                                                    h_layout, True)
                        m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                        l = gl.zeros([BLOCK_M], gl.float32, row_s)
                        acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
                elif (c % SEG_CHUNKS) == 0:  # a segment's first chunk folds before its q.k^T (S not live beside O)
                    mbarrier.arrive(bars.index(TURN + NEXT), count=1)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
                    mbarrier.arrive(bars.index(EV + sv), count=1)
                    # the first fold (c == SEG_CHUNKS) finds O = 0, as the registers' version does
                    M, L, O = _fold_smem(M, L, m, l, acc, o_smem.index(WHICH), c > SEG_CHUNKS, row_o, o_layout)
                    o_smem.index(WHICH).store(O)
                    m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                    l = gl.zeros([BLOCK_M], gl.float32, row_s)
                    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
                    s_tok = warpgroup_mma(q_smem, bufs_k.index(sk).permute((1, 0)), zero_s, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
                else:
                    acc, s = _qk_turn(q_smem, bufs_k.index(sk), zero_s, bars.index(TURN + NEXT), acc_tok)
                    mbarrier.arrive(bars.index(EV + sv), count=1)
                mbarrier.arrive(bars.index(EK + sk), count=1)
                s = _mask(s, c, n_full, kcol, qpos, BLOCK_N, NFULL)
                m, l, acc, p = _softmax(s, m, l, acc, qk_scale, row_o, p_layout, 0)
            sl = (nc_cta - 1) % SV
            mbarrier.wait(bars.index(RV + sl), ((nc_cta - 1) // SV) & 1)
            acc = warpgroup_mma(p, bufs_v.index(sl), acc)  # the last chunk's p.v
            mbarrier.arrive(bars.index(EV + sl), count=1)
            if FOLD:  # O's halves joined again (the registers are free here: no S)
                M, L, O0, O1 = _fold_halves(M, L, m, l, acc, o_smem, 2 * WHICH, nc_cta > SEG_CHUNKS and DIAG != 3,
                                            row_o, h_layout, False)
                O = gl.convert_layout(gl.reshape(gl.permute(gl.join(O0, O1), (0, 2, 1)), [BLOCK_M, D]), o_layout)
            else:
                M, L, O = _fold_smem(M, L, m, l, acc, o_smem.index(WHICH), nc_cta > SEG_CHUNKS, row_o, o_layout)
            out = gl.div_rn(O, gl.convert_layout(L, row_o)[:, None])
            q_smem.store(out.to(gl.bfloat16))  # the query tile's shared memory, no longer read, turns the layout
            gl.thread_barrier()
            _store_out(o_ptr, q_smem.load(ld_layout), tok0, q_start, q_len, kvh, sot, soh, G, BLOCK_M, D, ld_layout)
            if STORE_LSE:
                _store_lse(lse_ptr, M, L, rs, tok0, q_start, q_len, kvh, hq, G, BLOCK_M)

"""The Gluon prefill with three consumer warpgroups (`_prefill3_kernel`): `attention_gluon._prefill_kernel`'s
arithmetic, op for op, for three adjacent 64-row query tiles a CTA — the library's Gluon prefill since session 42.

Why three: a consumer's 64-key chunk is ~630 cycles of its own wgmmas and ~1,000 of softmax (session 41's %clock64
timeline), so with two consumers each softmax chain is longer than the other consumer's MMAs and the tensor cores
idle (~71 % busy); with three, each chain hides behind two consumers' MMAs. Sessions 36-40 built it (every version
bit-equal to the Triton kernel) and found it no faster once the contract's 512-key segment folds ran: all three
consumers fold at the same chunk. Session 42 moved the contract's split size to 2,048 keys (contracts/gpu.py,
attention v2), where the folds are rare, and measured it at 1.07-1.09x the two-consumer kernel (H100, interleaved
rounds: 8 x 4,096 tokens 0.908x SDPA against 0.849x, 2 x 16,384 0.935x against 0.871x; benchmarks/H100_session42).
Shorter requests leave more of a group's last CTA idle: `attention_gluon.consumers_for` launches this kernel where the
longest request has >= `attention_gluon.THREE_FROM` (1,536) tokens, the two-consumer kernel below.

The schedule, as the two-consumer kernel's with a three-way turn:
* one producer warp loads chunk c's K into a ring of KSTAGES stages and its V into a ring of VSTAGES (K is read a
  turn before V, so each ring frees at its own pace; three 16 KB query tiles and three 32 KB O tiles beside them);
* consumer i waits for turn i, issues chunk c - 1's p.v and chunk c's q.k^T (async), hands the turn to consumer
  i + 1 mod 3, waits for both, and runs chunk c's softmax while the others' tensor-core work runs;
* the finished segments' (M, L, O): M and L in registers, O (fp32) in this consumer's shared tile as two column
  halves (`_fold_halves`: 32 registers of O at a time, so the fold runs with chunk c's scores live, after the turn's
  waits, beside the other consumers' MMAs). The first fold finds O = 0, as the registers' version does;
* every consumer walks the CTA's chunks (the group's last live tile's count): a chunk past every row of a tile is
  the causal mask's exact identity, as in the two-consumer kernel.
The output tile leaves through the query tile's shared memory in 16-byte stores, as the two-consumer kernel's.

DIAG 3 (measurement only, other bits; the library never sets it): no segment folds.
"""
from __future__ import annotations

KSTAGES = 2  # K chunks in flight (session 39: K 3 + V 2 faulted at a turn's arrive, cause not found; K 2 + V 3 runs)
VSTAGES = 3  # V chunks in flight
CONSUMER_REGS = 168  # three consumers: 13 warps share the register file (the producer warp keeps 24)

try:  # as attention_gluon's: where Gluon does not import, nothing here is defined and that module says why
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

if _IMPORT_ERROR is None:
    from .attention_gluon_parts import (_cta, _ld_layout, _load_q, _mask, _merge_stats, _mma_layout, _qk_turn,
                                        _softmax, _store_lse, _tile_rows)
    from .launch import fast

    _CONSUMER3_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(24)

    @gluon.jit
    def _shared3(k_desc, v_desc, KS: gl.constexpr, VS: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr):
        """A CTA's shared memory: the K ring (KS stages), the V ring (VS), the three query tiles, the three consumers'
        O as column halves (o_all[2 i], o_all[2 i + 1]: consumer i's), and the barriers — ready K, ready V, empty K,
        empty V (a stage is free when all three consumers released it), the turns — initialised."""
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
        o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D // 2], gl.float32)
        bufs_k = gl.allocate_shared_memory(k_desc.dtype, [KS] + k_desc.block_type.shape, k_desc.layout)
        bufs_v = gl.allocate_shared_memory(v_desc.dtype, [VS] + v_desc.block_type.shape, v_desc.layout)
        q_all = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_M, D], q_layout)
        o_all = gl.allocate_shared_memory(gl.float32, [6, BLOCK_M, D // 2], o_layout)
        bars = gl.allocate_shared_memory(gl.int64, [2 * KS + 2 * VS + 3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(KS + VS):
            mbarrier.init(bars.index(i), count=1)  # ready: K stages, then V stages
            mbarrier.init(bars.index(KS + VS + i), count=3)  # empty: likewise
        for i in gl.static_range(3):
            mbarrier.init(bars.index(2 * (KS + VS) + i), count=1)  # the turns
        return bufs_k, bufs_v, q_all, o_all, bars

    @gluon.jit
    def _producer3(k_desc, v_desc, bufs_k, bufs_v, bars, kv_start, kvh, nc_cta, BLOCK_N: gl.constexpr,
                   D: gl.constexpr):
        """One warp: chunk c's K once its K stage is free, then its V once its V stage is."""
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
            tma.async_copy_global_to_shared(v_desc, [kv_start + c * BLOCK_N, kvh * D], bars.index(SK + sv),
                                            bufs_v.index(sv))

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
        """`attention._merge` with O in shared memory as two column halves o_all[i0], o_all[i0 + 1]: each half loaded
        (when `have_o`, else the zero O starts as), folded and (STORE) stored back before the next, so a fold needs
        32 registers of O, not 64. fma(O, a, o * b) on each element, as `_merge`. Returns (M, L, O's halves)."""
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
    def _store_out(o_ptr, out_ld, tok0, q_start, q_len, kvh, sot, soh, G: gl.constexpr, BLOCK_M: gl.constexpr,
                   D: gl.constexpr, ld_layout: gl.constexpr):
        """The output tile (in the query load's blocked layout: 16-byte stores) to its rows, the addresses made afresh
        (an opaque zero: not the query load's, which would then live across the chunk loop)."""
        TOK: gl.constexpr = BLOCK_M // G
        z = gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        r2 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout)) + z
        d2 = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
        tok2 = tok0 + r2 // G
        qrow2 = (q_start + gl.minimum(tok2, q_len - 1)).to(gl.int64)
        gl.store(o_ptr + qrow2[:, None] * sot + (kvh * G + r2 % G)[:, None] * soh + d2[None, :],
                 out_ld.to(o_ptr.dtype.element_ty), mask=((tok2 < q_len) & (r2 < TOK * G))[:, None])

    @gluon.jit
    def _consumer3(q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_smem, o_all, bufs_k, bufs_v, bars, sqt, sqh, sot,
                   soh, hq, qk_scale, grp, req, kvh, nc_cta, WHICH: gl.constexpr, G: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, SEG_CHUNKS: gl.constexpr,
                   STORE_LSE: gl.constexpr, NFULL: gl.constexpr, DIAG: gl.constexpr):
        """Query tile WHICH of the CTA's three (module docstring): chunk c's q.k^T and chunk c - 1's p.v in its turn,
        then chunk c's softmax; a segment's first chunk folds the finished segment after the turn's waits."""
        s_layout: gl.constexpr = _mma_layout(BLOCK_N)
        o_layout: gl.constexpr = _mma_layout(D)
        h_layout: gl.constexpr = _mma_layout(D // 2)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        ld_layout: gl.constexpr = _ld_layout()
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        TOK: gl.constexpr = BLOCK_M // G
        SK: gl.constexpr = bufs_k.type.shape[0]
        SV: gl.constexpr = bufs_v.type.shape[0]
        RK: gl.constexpr = 0  # bars: ready K, ready V, empty K, empty V, turns
        RV: gl.constexpr = SK
        EK: gl.constexpr = SK + SV
        EV: gl.constexpr = 2 * SK + SV
        TURN: gl.constexpr = 2 * (SK + SV)
        tok0 = (grp * 3 + WHICH) * TOK
        FIRST: gl.constexpr = 1 if WHICH == 0 else 0  # consumer 0 opens: a fresh barrier passes parity 1
        NEXT: gl.constexpr = (WHICH + 1) % 3
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
                acc, s = _qk_turn(q_smem, bufs_k.index(sk), zero_s, bars.index(TURN + NEXT), acc_tok)
                mbarrier.arrive(bars.index(EV + sv), count=1)
                if (c % SEG_CHUNKS) == 0 and DIAG != 3:  # chunk c opens a segment: fold the finished one
                    M, L, O0, O1 = _fold_halves(M, L, m, l, acc, o_all, 2 * WHICH, c > SEG_CHUNKS, row_o, h_layout,
                                                True)
                    m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                    l = gl.zeros([BLOCK_M], gl.float32, row_s)
                    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
                mbarrier.arrive(bars.index(EK + sk), count=1)
                s = _mask(s, c, n_full, kcol, qpos, BLOCK_N, NFULL)
                m, l, acc, p = _softmax(s, m, l, acc, qk_scale, row_o, p_layout, 0)
            sl = (nc_cta - 1) % SV
            mbarrier.wait(bars.index(RV + sl), ((nc_cta - 1) // SV) & 1)
            acc = warpgroup_mma(p, bufs_v.index(sl), acc)  # the last chunk's p.v
            mbarrier.arrive(bars.index(EV + sl), count=1)
            # the last segment folded; O's halves joined again (the registers are free here: no S)
            M, L, O0, O1 = _fold_halves(M, L, m, l, acc, o_all, 2 * WHICH, nc_cta > SEG_CHUNKS and DIAG != 3,
                                        row_o, h_layout, False)
            O = gl.convert_layout(gl.reshape(gl.permute(gl.join(O0, O1), (0, 2, 1)), [BLOCK_M, D]), o_layout)
            out = gl.div_rn(O, gl.convert_layout(L, row_o)[:, None])
            q_smem.store(out.to(gl.bfloat16))  # the query tile's shared memory, no longer read, turns the layout
            gl.thread_barrier()
            _store_out(o_ptr, q_smem.load(ld_layout), tok0, q_start, q_len, kvh, sot, soh, G, BLOCK_M, D, ld_layout)
            if STORE_LSE:
                _store_lse(lse_ptr, M, L, rs, tok0, q_start, q_len, kvh, hq, G, BLOCK_M)

    @gluon.jit
    def _prefill3_kernel(q_ptr, o_ptr, lse_ptr, k_desc, v_desc, qs_ptr, ql_ptr, kl_ptr, ks_ptr, sqt, sqh, sot, soh,
                         qk_scale, n_groups, G: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         D: gl.constexpr, SEG_CHUNKS: gl.constexpr, KS: gl.constexpr, VS: gl.constexpr,
                         STORE_LSE: gl.constexpr, NFULL: gl.constexpr, DIAG: gl.constexpr, num_warps: gl.constexpr):
        """Grid (groups of three query tiles, the group holding the latest tokens first; requests; kv heads)."""
        grp, req, kvh, kv_start, nc_cta, hq = _cta(n_groups, ql_ptr, kl_ptr, ks_ptr, G, BLOCK_M, BLOCK_N, 3)
        bufs_k, bufs_v, q_all, o_all, bars = _shared3(k_desc, v_desc, KS, VS, BLOCK_M, D)
        gl.warp_specialize([
            (_consumer3, (q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(0), o_all, bufs_k, bufs_v, bars,
                          sqt, sqh, sot, soh, hq, qk_scale, grp, req, kvh, nc_cta, 0, G, BLOCK_M, BLOCK_N, D,
                          SEG_CHUNKS, STORE_LSE, NFULL, DIAG)),
            (_producer3, (k_desc, v_desc, bufs_k, bufs_v, bars, kv_start, kvh, nc_cta, BLOCK_N, D)),
            (_consumer3, (q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(1), o_all, bufs_k, bufs_v, bars,
                          sqt, sqh, sot, soh, hq, qk_scale, grp, req, kvh, nc_cta, 1, G, BLOCK_M, BLOCK_N, D,
                          SEG_CHUNKS, STORE_LSE, NFULL, DIAG)),
            (_consumer3, (q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(2), o_all, bufs_k, bufs_v, bars,
                          sqt, sqh, sot, soh, hq, qk_scale, grp, req, kvh, nc_cta, 2, G, BLOCK_M, BLOCK_N, D,
                          SEG_CHUNKS, STORE_LSE, NFULL, DIAG)),
        ], [1, 4, 4], [_PRODUCER_REGS, _CONSUMER3_REGS, _CONSUMER3_REGS])

    _prefill3_fast = fast(_prefill3_kernel)  # launch.py's fast path (the launches attention_gluon.launch makes)

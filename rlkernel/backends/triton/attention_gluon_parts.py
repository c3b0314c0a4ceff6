"""The Gluon prefill kernel's device pieces below a consumer (attention_gluon's module docstring): `attention._merge`'s
row stats and fold, a chunk's softmax, the turn's q.k^T, the causal mask, a consumer's request rows, query load and
lse store. Inlined into the kernel that calls them: the same ops, wherever they live."""
from __future__ import annotations

try:  # as attention_gluon's: where Gluon does not import, nothing here is defined and that module says why
    from triton.experimental import gluon
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon import language as gl
    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

if _IMPORT_ERROR is None:
    @gluon.constexpr_function
    def _mma_layout(n):
        """The wgmma accumulator layout of a 64-row tile n columns wide on one warpgroup (NVMMA v3, 4 warps, instr
        16 x n x 16): the Triton kernel's score (n = BLOCK_N) and output (n = D) layouts, which fix the row reductions'
        order; every Gluon prefill consumer takes its layouts from here."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def _ld_layout():
        """The query load's and the output store's blocked layout (16-byte accesses: 8 bf16 a thread)."""
        return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    @gluon.jit
    def _merge_stats(M, L, m, l):
        """attention._merge's row part: the merged max and sum, and the scales a (of O) and b (of o)."""
        M_new = gl.maximum(M, m)
        Ms = gl.where(M_new == float("-inf"), 0.0, M_new)
        a = gl.where(M_new == M, 1.0, gl.exp2(M - Ms))
        b = gl.where(M_new == m, 1.0, gl.exp2(m - Ms))
        return M_new, gl.fma(L, a, l * b), a, b

    @gluon.jit
    def _merge(M, L, O, m, l, o, row_o: gl.constexpr):
        """attention._merge: (M, L, O) <- (M, L, O) (+) (m, l, o), the same ops in the same order."""
        M_new, L, a, b = _merge_stats(M, L, m, l)
        O = gl.fma(O, gl.convert_layout(a, row_o)[:, None], o * gl.convert_layout(b, row_o)[:, None])
        return M_new, L, O

    @gluon.jit
    def _softmax(s, m, l, acc, qk_scale, row_o: gl.constexpr, p_layout: gl.constexpr, SKIP: gl.constexpr, tr=None,
                 tr_idx=0, tr_on=0):
        """attention._chunk between its two dots (s already masked): the new row max, alpha, p, l, acc * alpha, and p
        as the bf16 A operand of the p.v wgmma. SKIP: leave acc alone when no row's max moved (every alpha is then
        1.0 exactly, and acc * 1.0 == acc bit for bit), at the cost of a tile-wide test (a cross-warp reduction)."""
        m_new, alpha, l, p = _stats(s, m, l, qk_scale, p_layout, tr, tr_idx, tr_on)
        if SKIP:
            if gl.max((m_new != m).to(gl.int32), 0) != 0:
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        else:
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        return m_new, l, acc, p

    @gluon.jit
    def _stats(s, m, l, qk_scale, p_layout: gl.constexpr, tr=None, tr_idx=0, tr_on=0):
        """`_softmax` without the accumulator's rescale: the new row max, alpha, l and p (bf16, the p.v operand).
        tr (DIAG 4's timeline): %clock64 once the new row max exists (tr[tr_idx]) and once l does (tr[tr_idx + 1])."""
        m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
        if tr is not None:
            _stamp_after(tr, tr_idx, tr_on, m_new)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.where(m_new == m, 1.0, gl.exp2(m - m_safe))
        p32 = gl.exp2(gl.fma(s, qk_scale, -m_safe[:, None]))
        l = l * alpha + gl.sum(p32, 1)
        if tr is not None:
            _stamp_after(tr, tr_idx + 1, tr_on, l)
        return m_new, alpha, l, gl.convert_layout(p32.to(gl.bfloat16), p_layout)

    @gluon.jit
    def _qk_turn(qa, k_tile, zero_s, next_turn, acc_tok):
        """The turn's second half: issue chunk c's q.k^T behind the running p.v (acc_tok), hand the turn on, wait for
        both: (acc, s)."""
        s_tok = warpgroup_mma(qa, k_tile.permute((1, 0)), zero_s, is_async=True)
        mbarrier.arrive(next_turn, count=1)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, s_tok))

    @gluon.jit
    def _stamp(ptr, idx, on):
        """DIAG 4 (measurement only): the SM's cycle counter (%clock64) into ptr[idx] (int64) from the 4-warp
        partition's thread 0, where `on` (the asm runs once per element: one element a thread; not pure, so kept)."""
        i = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [i], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(ptr + idx + i * 0, t, mask=(i == 0) & on)

    @gluon.jit
    def _stamp_after(ptr, idx, on, x):
        """`_stamp` once the row values x ([BM] of the score layout's rows) exist: the asm reads them, so it waits for
        them (row 0's, from a thread of warp 0)."""
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,f", [x], dtype=gl.int64, is_pure=False, pack=1)
        r = gl.arange(0, x.type.shape[0], layout=x.type.layout)
        gl.store(ptr + idx + r * 0, t, mask=(r == 0) & on)

    @gluon.jit
    def _mask(s, c, n_full, kcol, qpos, BLOCK_N: gl.constexpr, NFULL: gl.constexpr):
        """Chunk c's causal mask: on the chunks some row of the tile does not see in full (NFULL) or on every chunk."""
        if NFULL:
            if c >= n_full:
                s = gl.where((c * BLOCK_N + kcol)[None, :] <= qpos[:, None], s, float("-inf"))
        else:
            s = gl.where((c * BLOCK_N + kcol)[None, :] <= qpos[:, None], s, float("-inf"))
        return s

    @gluon.jit
    def _chunks(grp, q_len, kv_len, TOK: gl.constexpr, BLOCK_N: gl.constexpr, NCONS: gl.constexpr):
        """The chunks a CTA's group of NCONS query tiles walks: its last live tile's (0 for a group past the request)."""
        nc = 0
        if grp * NCONS * TOK < q_len:  # the CTA's last live tile sees the most chunks
            t_last = gl.minimum(grp * NCONS + (NCONS - 1), (q_len - 1) // TOK)
            nc = (kv_len - q_len + gl.minimum(t_last * TOK + TOK, q_len) - 1) // BLOCK_N + 1
        return nc

    @gluon.jit
    def _cta(n_groups, ql_ptr, kl_ptr, ks_ptr, G: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             NCONS: gl.constexpr):
        """This CTA's work item: (its group of NCONS query tiles, the group holding the latest tokens first; request;
        kv head; the request's first key row; the chunks the group walks; the query heads)."""
        grp = n_groups - 1 - gl.program_id(0)
        req = gl.program_id(1)
        kvh = gl.program_id(2)
        q_len = gl.load(ql_ptr + req)
        kv_len = gl.load(kl_ptr + req)
        kv_start = gl.load(ks_ptr + req)
        nc_cta = _chunks(grp, q_len, kv_len, BLOCK_M // G, BLOCK_N, NCONS)
        return grp, req, kvh, kv_start, nc_cta, gl.num_programs(2) * G

    @gluon.jit
    def _tile_rows(ql_ptr, qs_ptr, kl_ptr, req, tok0, BLOCK_N: gl.constexpr):
        """A consumer's request: (q_len, q_start, the first query's key position, the chunks every row of the tile
        starting at token tok0 sees in full)."""
        q_len = gl.load(ql_ptr + req)
        q_start = gl.load(qs_ptr + req)
        kv_len = gl.load(kl_ptr + req)
        first = kv_len - q_len
        return q_len, q_start, first, (first + tok0 + 1) // BLOCK_N

    @gluon.jit
    def _load_q(q_ptr, q_smem, q_start, q_len, kvh, tok0, sqt, sqh, G: gl.constexpr, BLOCK_M: gl.constexpr,
                D: gl.constexpr, ld_layout: gl.constexpr):
        """The query tile (G heads of 64 // G tokens) into its shared memory, fenced for the wgmmas; returns the rows'
        (qrow, head, row_ok, d) for a store from the same layout."""
        TOK: gl.constexpr = BLOCK_M // G
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
        tok = tok0 + r // G
        row_ok = (tok < q_len) & (r < TOK * G)
        qrow = (q_start + gl.minimum(tok, q_len - 1)).to(gl.int64)
        head = kvh * G + r % G
        q = gl.load(q_ptr + qrow[:, None] * sqt + head[:, None] * sqh + d[None, :], mask=row_ok[:, None], other=0.0)
        q_smem.store(q)
        fence_async_shared()
        return qrow, head, row_ok, d

    @gluon.jit
    def _store_lse(lse_ptr, M, L, rs, tok0, q_start, q_len, kvh, hq, G: gl.constexpr, BLOCK_M: gl.constexpr):
        """attention._store_lse, from the final (M, L), in the score layout's rows."""
        TOK: gl.constexpr = BLOCK_M // G
        tok_s = tok0 + rs // G
        ok_s = (tok_s < q_len) & (rs < TOK * G)
        qrow_s = (q_start + gl.minimum(tok_s, q_len - 1)).to(gl.int64)
        gl.store(lse_ptr + qrow_s * hq + (kvh * G + rs % G), (M + gl.log2(L)) * 0.6931471805599453, mask=ok_s)

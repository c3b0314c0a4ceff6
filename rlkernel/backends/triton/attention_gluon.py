"""The packed varlen causal prefill of `AttentionContract` on Hopper (sm_90), written in Gluon with warp
specialisation: the same bits as `attention._attn_fwd`, scheduled as FlashAttention 3 schedules its forward.

Same arithmetic, op for op (checked against the Triton kernel's TTGIR on a CPU machine, and bit for bit on the H200:
benchmarks/h200_session27, `scripts/gpu_gluon_attn.py`): a 64-row query tile = (64 // G) tokens x the G query heads
of one kv head; keys in 64-key chunks at absolute positions; s = q.k^T one wgmma m64n64 k16 chain from zero, in the
Triton kernel's score layout (NVMMA v3, 4 warps, instr 16 x 64 x 16: it fixes the row reductions' order); m, alpha,
p and l as `attention._chunk` (exp2, fma, no fp contraction); p cast to bf16 and p.v one wgmma m64n128 chain onto
acc * alpha; the contract's segments (seg_keys: 2,048 keys since v2, 512 before) folded into (M, L, O) by
`attention._merge` at each segment's first chunk; out =
div_rn(O, L); lse = (M + log2 L) ln 2 on request.

The schedule (what the Triton kernel cannot express in Triton 3.6):
* a CTA runs two adjacent query tiles, one consumer warpgroup each, and one producer warp that loads K / V chunks
  through TMA into a ring of `STAGES` shared-memory stages, once for both tiles (a stage is reused when both
  consumers released it); `setmaxnreg` gives the producer's registers to the consumers;
* ping-pong (FA3): in its turn a consumer issues chunk c - 1's p.v and chunk c's q.k^T together (async), hands the
  turn to the other consumer, waits for both and runs chunk c's softmax while the other's tensor-core work runs;
* both consumers walk the CTA's chunks: a chunk past every row of a tile is an exact identity under the causal mask
  (p == 0, alpha == 1, a segment of such chunks merges as (-inf, 0, 0)) — the contract's own property (the decode
  tile holds later rows too) — so the turns stay paired without a branch; the mask is applied only to chunks some
  row of the tile does not see in full, as the Triton kernel's unmasked loop.

Measured on the H200 (8 x 4,096 tokens, 32 / 8 heads, D 128; session 27 call 4): 453 TFLOP/s against the Triton
kernel's 434 (1.045x; 0.6B heads 1.08x; 4 x 1,024 1.12x), equal bits on every row of a 12-request mixed-length
batch. Its ceiling with this contract's 64-key chunks: the same kernel without the softmax ran 620 TFLOP/s, without
q.k^T 516 — the per-chunk softmax (two row reductions, 32 exp2 and 64 acc rescales a thread) is what is left.
Session 34: the output tile stored 16 bytes a thread — 466 TFLOP/s on the H200 (1.08-1.11x the Triton
kernel, 0.82-0.83x SDPA in interleaved rounds; benchmarks/h200_session34/call2), the same bits.
Session 41 (H100; DIAG 4's %clock64 timeline, `gpu_gluon_attn.py --trace`): a consumer's chunk is ~150 cycles of
waits, ~630 of its wgmmas and ~1,000 of softmax (~240 to the row max, ~485 for the exp2s and the row sum, ~250
after), so each consumer's own chain is the period and the tensor cores are ~71 % busy; two chunks a turn (one
m64n128 q.k^T), the row max as a tree and the rescale moved into the next turn were bit-equal and none faster
(benchmarks/H200_NOTES.md, session 41).

Since session 42 the library runs `attention_gluon3._prefill3_kernel` (three consumer warpgroups a CTA, the same
arithmetic) where the longest request has >= 1,536 tokens (`CONSUMERS`, `THREE_FROM`; RLKERNEL_ATTENTION_CONSUMERS).
Sessions 36-40 had built it and found it no faster while every consumer folded a segment each 512 keys; with the
contract's 2,048-key segments (v2) it runs 1.05-1.09x this kernel on an H100 at 4,096-16,384 tokens a request
(benchmarks/H200_NOTES.md, session 42).

Layout: this module holds the two-consumer kernel (`_prefill_kernel`), its consumer, producer and shared memory, and
the host side of both kernels (launch, checks); `attention_gluon3.py` the three-consumer kernel; `attention_gluon_parts.py`
the device pieces below a consumer (merge, softmax, mask, the turn, the query load and the lse store).

Used by `attention.attention_varlen` where `unsupported_reason` is None (sm_90, bf16, head dim 128, the contract's
64 x 64 tiles, K / V through TMA, the unsplit flat walk, Triton 3.6, and a first-use check per device and head group
that this kernel and the Triton kernel give equal bits and lse on a small mixed batch); `RLKERNEL_ATTENTION_GLUON=0`
keeps the Triton kernel everywhere. Gluon is Triton 3.6's experimental dialect: where it does not import, the reason
says so and the Triton kernel runs (the same bits either way).

Host time (small batches wait for the host): `launch` goes through launch.py's fast path, as the Triton kernels do — a
key's first call through Triton's own `JITFunction.run` (compiling), later calls the CompiledKernel it returned
(`verify` checks it is the one Triton's own launch picks; RLKERNEL_TRITON_FAST_LAUNCH=0 or a launch hook takes
Triton's own path every call) — and the K / V tiles' shared layout is made once (`kv_layout`). Left per call, this
kernel's own: two TensorDescriptors (without the constructor's checks: gluon_checks.descriptor) and, in Triton's
launcher, their two tensor maps encoded on the host (the Triton kernel makes its descriptors on the device). Host time per call on the H200 (16 x 256 tokens, after
session 28, `gpu_gluon_attn.py` host_us): the library call 113 us (135 as session 28 launched it, a fresh layout and
Triton's own run every call; 93 on the Triton kernel), `launch` alone 37 us (46 through Triton's own run).
"""
from __future__ import annotations

import os
import sys

from .gluon_checks import arch_reason, describe_checks, descriptor, first_use, gate_reason, switched_off
from .launch import fast

ENV = "RLKERNEL_ATTENTION_GLUON"
_ENABLED = os.environ.get(ENV, "1") != "0"


def off():
    """Within: attention_varlen runs the Triton kernel everywhere in this process (as RLKERNEL_ATTENTION_GLUON=0 does)
    — the reference side of the benchmarks and tests that compare the two."""
    return switched_off(sys.modules[__name__])

QREG = 0  # q.k^T's query tile from registers (`_consumer`; session 33: bit-equal, within a timing's spread: off)
QK_FIRST = 0  # chunk c's q.k^T issued before chunk c - 1's p.v (`_consumer`; session 33: bit-equal, no faster: off)
STAGES = 4  # K / V chunks in flight (session 27: 3 and 4 within one timing's spread of each other; 2 stages 0.6x)
PRODUCER_REGS = 24
CONSUMER_REGS = 232  # the worker consumer's registers (the default partition gets the rest: 256)
_LOG2E = 1.4426950408889634
CONSUMERS_ENV = "RLKERNEL_ATTENTION_CONSUMERS"
# which kernel the library launches (the same bits either way: the first-use check compares each one it may launch
# with the Triton kernel): "auto" (the default) three consumer warpgroups a CTA (`attention_gluon3._prefill3_kernel`)
# where the longest request has at least THREE_FROM query tokens, else two (`_prefill_kernel`); "2" / "3" always that
# one. Session 42 (H100, the contract's 2,048-key segments; benchmarks/H100_session42/call3, call5): three 1.05x two at
# 8 x 1,536, 1.04-1.05x at 4 x 2,048, 1.07-1.09x at 4 x 3,072 and 8 x 4,096, 1.04-1.07x on a packed batch of 16 requests
# of 256-4,096 tokens; two 1.06x three at 4 x 1,024 and 1.16x at 16 x 256 (a group of three tiles wastes more of a short
# request's last CTA)
THREE_FROM = 1536
_MODES = {"auto": 0, "2": 2, "3": 3}
if os.environ.get(CONSUMERS_ENV, "auto") not in _MODES:
    raise ValueError(f"{CONSUMERS_ENV}={os.environ[CONSUMERS_ENV]!r}: expected auto, 2 or 3")
CONSUMERS = _MODES[os.environ.get(CONSUMERS_ENV, "auto")]  # 0: auto
_FORCED = [0]  # self_check's: the kernel to take regardless of CONSUMERS (0: none forced)


def consumers_for(n_tiles: int, tok: int) -> int:
    """The consumer warpgroups of the library's launch for n_tiles query tiles of tok tokens (`CONSUMERS`)."""
    c = _FORCED[0] or CONSUMERS
    return c if c else 3 if n_tiles * tok >= THREE_FROM else 2


try:  # Gluon ships with Triton >= 3.5 as `triton.experimental.gluon`; its API is young, so any failure is a reason
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 (gluon_checks.descriptor's)
    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

if _IMPORT_ERROR is None:
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)

    from .attention_gluon_parts import (_cta, _ld_layout, _load_q, _mask, _merge, _mma_layout, _qk_turn, _softmax,
                                        _stamp, _stats, _store_lse, _tile_rows)

    @gluon.jit
    def _consumer(q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_smem, bufs_k, bufs_v, ready, empty, turn, sqt, sqh,
                  sot, soh, hq, qk_scale, pair, req, kvh, nc_cta, WHICH: gl.constexpr, G: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, SEG_CHUNKS: gl.constexpr,
                  STORE_LSE: gl.constexpr, NFULL: gl.constexpr, DIAG: gl.constexpr, SKIP: gl.constexpr,
                  QREG: gl.constexpr, QK_FIRST: gl.constexpr):
        """One query tile (consumer WHICH of the CTA's two), ping-ponged with the other (module docstring).
        NFULL: mask only the chunks some row does not see in full (1, production) or every chunk (0: the same bits).
        SKIP: `_softmax`'s rescale skip where no row's max moved (the same bits; session 28: 0.99-1.0x, off).
        DIAG (measurement only, other bits; never set by the library): 1 skips the softmax, 2 skips q.k^T, 3 the
        segment folds (no (M, L, O) held: what the registers would allow with O kept elsewhere); 4 keeps the bits of
        the output but stores no lse: an lse buffer given is an int64 buffer for the timeline of CTAs (0..3, 0, 0) —
        each chunk's %clock64 at the loop's top, once the turn is held, once its wgmmas are done, after its softmax
        (`_stamp`), and once its row max and its l exist (`_stamp_after`); [CTA, consumer, chunk < 128, 8 points];
        without one, no stamps.
        QREG: q.k^T takes the query tile from registers (loaded once from shared memory) instead of shared memory: the
        wgmma then reads only K from shared memory (q.k^T's 64-column chain reads 2 KB of Q and 2 KB of K a k-step).
        QK_FIRST: a turn issues chunk c's q.k^T before chunk c - 1's p.v and waits for q.k^T alone, so chunk c's row
        max, exp2 and row sum run while that p.v still runs; the rescale of acc (and a segment's fold) waits for it.
        Both are the same ops on the same values (the bits are checked against the Triton kernel).
        The output tile is stored from the query load's blocked layout (16 bytes a thread, whole 32-byte sectors), not
        from the accumulator's (4 bytes a thread; ncu: 16 of 32 bytes used a sector): the same values, 1.08-1.09x on an
        H100 (session 34; a persistent walk over the work items measured there ran 0.85x: commit 11899d9 has it)."""
        s_layout: gl.constexpr = _mma_layout(BLOCK_N)
        o_layout: gl.constexpr = _mma_layout(D)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        ld_layout: gl.constexpr = _ld_layout()
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        TOK: gl.constexpr = BLOCK_M // G
        S: gl.constexpr = bufs_k.type.shape[0]
        tok0 = (pair * 2 + WHICH) * TOK
        FIRST: gl.constexpr = 1 if WHICH == 0 else 0  # consumer 0 opens: a fresh barrier passes parity 1
        NEXT: gl.constexpr = 1 - WHICH
        q_len, q_start, first, n_full = _tile_rows(ql_ptr, qs_ptr, kl_ptr, req, tok0, BLOCK_N)
        if DIAG == 4:
            tr = lse_ptr.to(gl.pointer_type(gl.int64), bitcast=True)
            # (no stamps without an lse buffer: lse_ptr is then the output)
            tr_on = (gl.program_id(0) < 4 * STORE_LSE) & (gl.program_id(1) == 0) & (gl.program_id(2) == 0)
            tr_base = (gl.program_id(0) * 2 + WHICH) * 1024
        else:
            tr = None  # (`_softmax` stamps nothing)
            tr_on = 0
            tr_base = 0
        if nc_cta > 0:
            qrow, head, row_ok, d = _load_q(q_ptr, q_smem, q_start, q_len, kvh, tok0, sqt, sqh, G, BLOCK_M, D, ld_layout)
            if QREG:
                qa = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
            else:
                qa = q_smem
            rs = gl.arange(0, BLOCK_M, layout=row_s)
            qpos = first + gl.minimum(tok0 + rs // G, q_len - 1)
            kcol = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
            M = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
            L = gl.zeros([BLOCK_M], gl.float32, row_s)
            O = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
            m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
            l = gl.zeros([BLOCK_M], gl.float32, row_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
            # chunk 0: q.k^T in the first turn (consumer 0 first: a fresh barrier passes parity 1)
            mbarrier.wait(ready.index(0), 0)
            mbarrier.wait(turn.index(WHICH), FIRST)
            s_tok = warpgroup_mma(qa, bufs_k.index(0).permute((1, 0)), zero_s, is_async=True)
            mbarrier.arrive(turn.index(NEXT), count=1)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            s = gl.where(kcol[None, :] <= qpos[:, None], s, float("-inf"))
            m, l, acc, p = _softmax(s, m, l, acc, qk_scale, row_o, p_layout, SKIP)
            for c in range(1, nc_cta):
                st = c % S
                sp = (c - 1) % S
                if DIAG == 4:
                    _stamp(tr, tr_base + c * 8, tr_on & (c < 128))
                mbarrier.wait(ready.index(st), (c // S) & 1)
                mbarrier.wait(turn.index(WHICH), (c & 1) ^ FIRST)
                if DIAG == 4:
                    _stamp(tr, tr_base + c * 8 + 1, tr_on & (c < 128))
                if QK_FIRST:
                    s_tok = warpgroup_mma(qa, bufs_k.index(st).permute((1, 0)), zero_s, is_async=True)
                    acc_tok = warpgroup_mma(p, bufs_v.index(sp), acc, is_async=True)  # chunk c - 1's p.v
                    mbarrier.arrive(turn.index(NEXT), count=1)
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
                    s = _mask(s, c, n_full, kcol, qpos, BLOCK_N, NFULL)
                    if (c % SEG_CHUNKS) == 0:  # chunk c opens a segment: its stats start afresh
                        m_in = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                        l_in = gl.zeros([BLOCK_M], gl.float32, row_s)
                    else:
                        m_in = m
                        l_in = l
                    m_c, alpha, l_c, p_c = _stats(s, m_in, l_in, qk_scale, p_layout)
                    # p (chunk c - 1's, the running p.v's operand) stays alive until that p.v is done; p_c, l_c and
                    # alpha pass through the wait so that they are computed before it (else the compiler sinks the
                    # exp2s below it and nothing overlaps)
                    acc, p, p_c, l_c, alpha = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p, p_c, l_c, alpha))
                    p = p_c
                    mbarrier.arrive(empty.index(sp), count=1)
                    if (c % SEG_CHUNKS) == 0:  # fold the finished segment (its last p.v is in acc); acc * alpha of
                        M, L, O = _merge(M, L, O, m, l, acc, row_o)  # a zero accumulator is zero
                        acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
                    else:
                        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    m = m_c
                    l = l_c
                else:
                    acc_tok = warpgroup_mma(p, bufs_v.index(sp), acc, is_async=True)  # chunk c - 1's p.v
                    if DIAG == 2:
                        mbarrier.arrive(turn.index(NEXT), count=1)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
                        s = zero_s + c
                    else:
                        acc, s = _qk_turn(qa, bufs_k.index(st), zero_s, turn.index(NEXT), acc_tok)
                    if DIAG == 4:
                        _stamp(tr, tr_base + c * 8 + 2, tr_on & (c < 128))
                    mbarrier.arrive(empty.index(sp), count=1)
                    if DIAG != 3:  # (DIAG 3, measurement only, other bits: one segment, no (M, L, O) held)
                        if (c % SEG_CHUNKS) == 0:  # chunk c opens a segment: fold the finished one (its last p.v is in acc)
                            M, L, O = _merge(M, L, O, m, l, acc, row_o)
                            m = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
                            l = gl.zeros([BLOCK_M], gl.float32, row_s)
                            acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
                    if DIAG == 1:
                        p = gl.convert_layout(s.to(gl.bfloat16), p_layout)
                    else:
                        s = _mask(s, c, n_full, kcol, qpos, BLOCK_N, NFULL)
                        m, l, acc, p = _softmax(s, m, l, acc, qk_scale, row_o, p_layout, SKIP, tr, tr_base + c * 8 + 4,
                                                tr_on & (c < 128))
                        if DIAG == 4:  # (p's conversion may sink below the stamp: the stamp waits for nothing)
                            _stamp(tr, tr_base + c * 8 + 3, tr_on & (c < 128))
            sl = (nc_cta - 1) % S
            acc = warpgroup_mma(p, bufs_v.index(sl), acc)  # the last chunk's p.v
            mbarrier.arrive(empty.index(sl), count=1)
            M, L, O = _merge(M, L, O, m, l, acc, row_o)
            out = gl.div_rn(O, gl.convert_layout(L, row_o)[:, None])
            gl.store(o_ptr + qrow[:, None] * sot + head[:, None] * soh + d[None, :],
                     gl.convert_layout(out.to(o_ptr.dtype.element_ty), ld_layout), mask=row_ok[:, None])
            if STORE_LSE:
                if DIAG != 4:
                    _store_lse(lse_ptr, M, L, rs, tok0, q_start, q_len, kvh, hq, G, BLOCK_M)

    @gluon.jit
    def _producer(k_desc, v_desc, bufs_k, bufs_v, ready, empty, kv_start, kvh, nc_cta, BLOCK_N: gl.constexpr,
                  D: gl.constexpr):
        """One warp: chunk c's K and V tiles into stage c % S once both consumers released its previous use."""
        S: gl.constexpr = bufs_k.type.shape[0]
        for c in range(0, nc_cta):
            st = c % S
            mbarrier.wait(empty.index(st), ((c // S) & 1) ^ 1)  # a fresh barrier counts as released once
            mbarrier.expect(ready.index(st), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_start + c * BLOCK_N, kvh * D], ready.index(st), bufs_k.index(st))
            tma.async_copy_global_to_shared(v_desc, [kv_start + c * BLOCK_N, kvh * D], ready.index(st), bufs_v.index(st))

    @gluon.jit
    def _shared(k_desc, v_desc, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr):
        """A CTA's shared memory: the K / V ring, the two consumers' query tiles, and the ring's and the turn's
        barriers (a stage is free again when both consumers released it), initialised."""
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
        bufs_k = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        bufs_v = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_all = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, D], q_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        return bufs_k, bufs_v, q_all, ready, empty, turn

    @gluon.jit
    def _prefill_kernel(q_ptr, o_ptr, lse_ptr, k_desc, v_desc, qs_ptr, ql_ptr, kl_ptr, ks_ptr, sqt, sqh, sot, soh, qk_scale,
                        n_pairs, G: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                        SEG_CHUNKS: gl.constexpr, STAGES: gl.constexpr, STORE_LSE: gl.constexpr, NFULL: gl.constexpr,
                        DIAG: gl.constexpr, SKIP: gl.constexpr, QREG: gl.constexpr, QK_FIRST: gl.constexpr,
                        num_warps: gl.constexpr):
        """Grid (pairs of query tiles, the pair holding the latest tokens first; requests; kv heads)."""
        pair, req, kvh, kv_start, nc_cta, hq = _cta(n_pairs, ql_ptr, kl_ptr, ks_ptr, G, BLOCK_M, BLOCK_N, 2)
        bufs_k, bufs_v, q_all, ready, empty, turn = _shared(k_desc, v_desc, STAGES, BLOCK_M, D)
        gl.warp_specialize([
            (_consumer, (q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(0), bufs_k, bufs_v, ready, empty, turn,
                         sqt, sqh, sot, soh, hq, qk_scale, pair, req, kvh, nc_cta, 0, G, BLOCK_M, BLOCK_N, D,
                         SEG_CHUNKS, STORE_LSE, NFULL, DIAG, SKIP, QREG, QK_FIRST)),
            (_producer, (k_desc, v_desc, bufs_k, bufs_v, ready, empty, kv_start, kvh, nc_cta, BLOCK_N, D)),
            (_consumer, (q_ptr, o_ptr, lse_ptr, qs_ptr, ql_ptr, kl_ptr, q_all.index(1), bufs_k, bufs_v, ready, empty, turn,
                         sqt, sqh, sot, soh, hq, qk_scale, pair, req, kvh, nc_cta, 1, G, BLOCK_M, BLOCK_N, D,
                         SEG_CHUNKS, STORE_LSE, NFULL, DIAG, SKIP, QREG, QK_FIRST)),
        ], [1, 4], [_PRODUCER_REGS, _CONSUMER_REGS])

    _prefill_fast = fast(_prefill_kernel)  # launch.py's fast path (the launches `launch` makes)

    from . import attention_gluon3
    from .attention_gluon3 import KSTAGES as _KSTAGES3, VSTAGES as _VSTAGES3, _prefill3_fast


_ARCH: dict = {}  # device index -> its architecture (golden.gpu_arch), asked once
_CHECKED: dict = {}  # (device index, G) -> None (bit-equal to the Triton kernel) or why this kernel is off there
_CHECKING: list = []  # non-empty while the first-use check runs its Triton side
_LAUNCHES = [0]  # this kernel's launches in this process
_LAYOUTS: dict = {}  # (block_n, d) -> the K / V tiles' shared layout (`kv_layout`)
TESTED_TRITON = ("3.6",)  # Gluon is experimental: the Triton minor versions this kernel was bit-checked with


def unsupported_reason(q, k, cfg, G: int, d: int, *, paged: bool, split: bool, tma: bool, walk: str) -> str | None:
    """None where this kernel serves the call, else why the Triton kernel does (the same bits either way). The first
    call per device and query-head group runs `self_check` first: a bit that differs turns this kernel off there."""
    why = gate_reason(_ENABLED, ENV, _IMPORT_ERROR, TESTED_TRITON, _CHECKING)
    if why is not None:
        return why
    if paged or split or walk != "flat":
        return "paged, split or nested walk"
    if not tma:
        return "K / V not loadable through TMA"
    if q.dtype != k.dtype or str(q.dtype) != "torch.bfloat16":
        return "not bf16"
    if d != 128 or (cfg.block_m, cfg.block_n) != (64, 64) or cfg.seg_keys % 64 or G > 64 or 64 % G:
        return "not the measured shape (head dim 128, 64 x 64 tiles, a group dividing 64)"
    why = arch_reason(q.device, _ARCH)
    if why is not None:
        return why
    dev = q.device.index if q.device.index is not None else -1
    return first_use(_CHECKED, (dev, G), lambda: self_check(q.device, G, cfg))


def self_check(device, G: int, cfg) -> str | None:
    """At first use on a device for a query-head group G: a packed batch (lengths 2 x seg_keys + 88: two segment folds,
    the second onto a held O, and a partial chunk; 77: a partial chunk; 1: a one-token request; 2 kv heads, head dim
    128, bf16, fixed seed) through each Gluon kernel the library may launch (`CONSUMERS`: under auto, the
    three-consumer kernel, which this batch's length picks, and the two-consumer one) and through the Triton kernel;
    None when every output and lse is bit-equal, else the reason the Gluon prefill stays off (logged once; the Triton
    kernel's bits are the contract's). Costs the kernels' compiles at that shape class and a few ms."""
    import itertools
    import logging

    import torch

    from . import attention as A

    gen = torch.Generator(device="cpu").manual_seed(27)
    lens, hkv = [2 * cfg.seg_keys + 88, 77, 1], 2
    q, k, v = (torch.randn(sum(lens), h, 128, generator=gen).to(device=device, dtype=torch.bfloat16)
               for h in (hkv * G, hkv, hkv))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    try:
        launches = _LAUNCHES[0]
        y, lse = A.attention_varlen(q, k, v, cu, max_seqlen=max(lens), split=False, return_lse=True, config=cfg)
        if _LAUNCHES[0] == launches:
            raise RuntimeError("the check's first call did not reach this kernel")
        outs = [(y, lse)]
        if CONSUMERS == 0:  # auto: the two-consumer kernel too
            _FORCED[0] = 2
            try:
                outs.append(A.attention_varlen(q, k, v, cu, max_seqlen=max(lens), split=False, return_lse=True,
                                               config=cfg))
            finally:
                _FORCED[0] = 0
        _CHECKING.append(True)
        try:
            ref, ref_lse = A.attention_varlen(q, k, v, cu, max_seqlen=max(lens), split=False, return_lse=True, config=cfg)
        finally:
            _CHECKING.clear()
    except Exception as e:  # noqa: BLE001 -- a kernel that cannot run here is a reason, never a crash
        why = f"first-use check failed to run: {type(e).__name__}: {str(e)[:200]}"
    else:
        n = sum(int((y.view(torch.int16) != ref.view(torch.int16)).any(dim=-1).sum()) +
                int((lse.view(torch.int32) != ref_lse.view(torch.int32)).sum())  # bit patterns (a NaN equals itself)
                for y, lse in outs)
        why = None if n == 0 else f"first-use check: {n} values differ from the Triton kernel's"
    if why is not None:
        logging.getLogger(__name__).warning("rlkernel: the Gluon attention prefill is off on %s (G=%d): %s", device, G,
                                            why)
    return why


def kv_layout(block_n: int, d: int):
    """The shared-memory layout of a [block_n, d] bf16 K / V tile (the descriptors' and the kernel's): Triton's default
    for that shape, made once per (block_n, d) — `get_default_for` is a constexpr function that costs ~8 us a call on
    the host, and the layout is a frozen value (equal layouts, the same specialization string)."""
    lay = _LAYOUTS.get((block_n, d))
    if lay is None:
        lay = _LAYOUTS[(block_n, d)] = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)
    return lay


def _kv_descriptors(k, v, cfg, skt) -> tuple:
    """The K and V TensorDescriptors of a launch: [rows, hkv * d] with row stride skt, [block_n, d] tiles."""
    rows, hkv, d = k.shape
    lay = kv_layout(cfg.block_n, d)
    shape, strides, block = [rows, hkv * d], [skt, 1], [cfg.block_n, d]
    return descriptor(k, shape, strides, block, lay), descriptor(v, shape, strides, block, lay)


def _launch_args(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt, lse, stages, nfull, diag,
                 skip, qreg, qk_first):
    """(grid, positional args, keyword args) of one `_prefill_kernel` launch: what `launch` runs and `verify` checks."""
    hkv, d = k.shape[1:]
    n_pairs = -(-n_tiles // 2)
    args = (q, out, lse if lse is not None else out, *_kv_descriptors(k, v, cfg, skt), q_start, q_len, kv_len, kv_start,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), float(scale) * _LOG2E, n_pairs)
    kwargs = dict(G=q.shape[1] // hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d,
                  SEG_CHUNKS=cfg.seg_keys // cfg.block_n, STAGES=stages, STORE_LSE=lse is not None, NFULL=nfull,
                  DIAG=diag, SKIP=skip, QREG=qreg, QK_FIRST=qk_first, num_warps=4, enable_fp_fusion=False)
    return (n_pairs, q_len.shape[0], hkv), args, kwargs


def _launch3_args(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt, lse, nfull, diag):
    """(grid, positional args, keyword args) of one `attention_gluon3._prefill3_kernel` launch."""
    hkv, d = k.shape[1:]
    n_groups = -(-n_tiles // 3)
    args = (q, out, lse if lse is not None else out, *_kv_descriptors(k, v, cfg, skt), q_start, q_len, kv_len, kv_start,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), float(scale) * _LOG2E, n_groups)
    kwargs = dict(G=q.shape[1] // hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d,
                  SEG_CHUNKS=cfg.seg_keys // cfg.block_n, KS=_KSTAGES3, VS=_VSTAGES3, STORE_LSE=lse is not None,
                  NFULL=nfull, DIAG=diag, num_warps=4, enable_fp_fusion=False)
    return (n_groups, q_len.shape[0], hkv), args, kwargs


def _three_knobs(stages, diag, skip, qreg, qk_first) -> None:
    """Refuse the two-consumer kernel's knobs on the three-consumer kernel, which has none of them (diag 3 only)."""
    bad = {name: val for name, val, default in (("stages", stages, STAGES), ("skip", skip, 0), ("qreg", qreg, QREG),
                                                ("qk_first", qk_first, QK_FIRST)) if val != default}
    if diag not in (0, 3):
        bad["diag"] = diag
    if bad:
        raise ValueError(f"attention_gluon.launch: {bad} are knobs of the two-consumer kernel (consumers=2); the "
                         "three-consumer kernel takes diag 0 or 3 only")


def _plan(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt, lse, stages, nfull, diag, skip,
          qreg, qk_first, consumers):
    """(fast kernel, grid, positional args, keyword args) of the launch `launch` makes and `verify` checks."""
    if (consumers or consumers_for(n_tiles, cfg.block_m // (q.shape[1] // k.shape[1]))) == 3:
        _three_knobs(stages, diag, skip, qreg, qk_first)
        return (_prefill3_fast, *_launch3_args(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg,
                                                skt, lse, nfull, diag))
    return (_prefill_fast, *_launch_args(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt, lse,
                                         stages, nfull, diag, skip, qreg, qk_first))


def launch(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt, lse=None, *, stages=STAGES,
           nfull=1, diag=0, skip=0, qreg=QREG, qk_first=QK_FIRST, consumers=None):
    """attention._launch's packed unsplit prefill on a Gluon kernel (call it where `unsupported_reason` is None),
    through launch.py's fast path (module docstring: the compiled kernel Triton's own launch would run, less host
    time). consumers: 3 (`attention_gluon3`: three consumer warpgroups; stages, skip, qreg and qk_first are the
    two-consumer kernel's knobs and refused there; diag 3 only) or 2 (this module's `_prefill_kernel`); None: the
    library's choice (`consumers_for`)."""
    kern, grid, args, kwargs = _plan(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt, lse,
                                     stages, nfull, diag, skip, qreg, qk_first, consumers)
    _LAUNCHES[0] += 1
    kern[grid](*args, **kwargs)
    return out


def verify(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt, lse=None, *, stages=STAGES,
           nfull=1, diag=0, skip=0, qreg=QREG, qk_first=QK_FIRST, consumers=None) -> dict:
    """`launch`'s arguments through launch.py's `FastKernel.verify`: runs the kernel `launch` would run three times
    (fast path, fast path again, Triton's own `run`) into `out` / `lse` and says whether all three ran one compiled
    kernel (a GPU's check)."""
    kern, grid, args, kwargs = _plan(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt, lse,
                                     stages, nfull, diag, skip, qreg, qk_first, consumers)
    return kern.verify(grid, *args, **kwargs)


def describe() -> str:
    """For provenance: whether packed prefill may take this kernel in this process, and its first-use checks so far."""
    if not _ENABLED:
        return f"off ({ENV}=0)"
    if _IMPORT_ERROR is not None:
        return f"unavailable ({_IMPORT_ERROR})"
    which = {0: f"three consumer warpgroups where the longest request has >= {THREE_FROM} tokens, else two",
             2: "two consumer warpgroups", 3: "three consumer warpgroups"}[CONSUMERS]
    return (f"on where supported (sm_90, bf16, head dim 128; {which}: {CONSUMERS_ENV})"
            + describe_checks(_CHECKED, lambda k: f"G={k[1]}"))

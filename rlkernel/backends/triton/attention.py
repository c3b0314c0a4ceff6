"""Causal GQA attention in Triton under contracts.AttentionContract.

One formulation serves packed varlen prefill, paged-KV decode and chunked prefill:

* a query tile is BLOCK_M rows = (BLOCK_M // G) consecutive tokens of one request x the G
  query heads of one kv head, in every path (a decode token fills G rows of the tile,
  the rest are zero rows; where G does not divide BLOCK_M the last BLOCK_M % G rows are
  padding too), so q.k and p.v are the same tl.dot shapes everywhere;
* keys are walked in chunks of BLOCK_N at absolute positions; chunks are grouped into
  segments of SEG keys at absolute positions (a fixed split size, never a number of
  splits); each segment runs an online softmax from (-inf, 0, 0), and segments are merged
  left to right from (-inf, 0, 0) by one merge function;
* chunks or segments past a row's position are exact identities (p == 0, alpha == 1
  exactly, merge factor 0), so a tile that holds later tokens too gives an earlier row
  the bits it gets alone;
* fp contraction is off and the FMAs are explicit, so the in-register merge (one program
  walks every segment) and the combine kernel (one program per segment) do the same
  arithmetic: split and unsplit give the same bits, and the host may choose either;
* packed prefill loads K / V through tensor descriptors (the bulk copy engine, TMA) where the layout allows
  (`_tma_ok`), the paged cache through pointer loads: the same values reach the same dots, so the same bits
  (checked: the golden bits, the 1,123,092-token parity's hash, session 25); a tile whose keys all lie in segment 0
  runs that segment's chunk loop alone (the flat walk never folds there before its last merge);
* on an H200 (sm_90) the packed unsplit bf16 prefill runs `attention_gluon`'s kernel instead: the same arithmetic op for
  op in Gluon, warp-specialised and ping-ponged as FlashAttention 3 (1.04-1.12x this kernel's throughput, equal bits:
  benchmarks/h200_session27); `RLKERNEL_ATTENTION_GLUON=0` keeps this one;
* on request (varlen prefill, for training) the kernel that finishes a row also stores its
  log-sum-exp, lse = (M + log2 L) * ln 2 in natural log, from the final (M, L) of either path,
  so split and unsplit give the same lse bits too; the output path does not change.
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

from ... import dispatch
from . import contracts as C
from .tile import _dot
from .launch import fast, cdiv, interpreting, next_pow2
from .gemm import _ensure_allocator
from . import attention_gluon

# packed prefill's K / V through the bulk tensor copy engine (TMA; 1.17-1.26x the pointer loads on the H200, same bits:
# benchmarks/h200_session25/call1); RLKERNEL_ATTENTION_TMA=0 keeps the pointer loads (a check or a bisection)
_TMA_ENABLED = os.environ.get("RLKERNEL_ATTENTION_TMA", "1") != "0"


def tma_off():
    """Within: the packed prefill loads K / V through pointers (as RLKERNEL_ATTENTION_TMA=0 does) — the other side of
    the checks that TMA changes no bit."""
    from .gluon_checks import switched_off

    return switched_off(sys.modules[__name__], "_TMA_ENABLED")

_LOG2E = 1.4426950408889634
_NEG_INF = float("-inf")


@triton.jit
def _chunk(q, m, l, acc, k_ptr, v_ptr, bt_ptr, req, kvh, c, kv_len, kv_start, qpos, qk_scale,
           skb, skt, skh, sbt, MASK: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    kpos = c * BLOCK_N + tl.arange(0, BLOCK_N)
    if TMA:  # k_ptr / v_ptr are tensor descriptors of [rows, Hkv * D]: keys past kv_len are the next sequence's (or
        # zeros past the buffer), which the causal mask below makes p == 0 exactly, as the zero rows of the loads are
        k = k_ptr.load([kv_start + c * BLOCK_N, kvh * D])
        v = v_ptr.load([kv_start + c * BLOCK_N, kvh * D])
    else:
        valid = kpos < kv_len
        if PAGED:
            page = tl.load(bt_ptr + req * sbt + kpos // PAGE, mask=valid, other=0).to(tl.int64)
            roff = page * skb + (kpos % PAGE) * skt
        else:
            roff = (kv_start + kpos).to(tl.int64) * skt
        d = tl.arange(0, D)
        off = roff[:, None] + kvh * skh + d[None, :]
        k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
    s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
    if MASK:
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_new == m, 1.0, tl.exp2(m - m_safe))
    p = tl.exp2(tl.fma(s, qk_scale, -m_safe[:, None]))
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = _dot(p.to(v.dtype), v, acc, IEEE)
    return m_new, l, acc


@triton.jit
def _segment(q, seg, n_chunks, n_full, k_ptr, v_ptr, bt_ptr, req, kvh, kv_len, kv_start, qpos, qk_scale,
             skb, skt, skh, sbt, SEG_CHUNKS: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    c0 = seg * SEG_CHUNKS
    c1 = tl.minimum(c0 + SEG_CHUNKS, n_chunks)
    cf = tl.minimum(tl.maximum(n_full, c0), c1)
    for c in range(c0, cf):  # every key visible to every row of the tile
        m, l, acc = _chunk(q, m, l, acc, k_ptr, v_ptr, bt_ptr, req, kvh, c, kv_len, kv_start, qpos, qk_scale,
                           skb, skt, skh, sbt, False, PAGED, PAGE, BLOCK_M, BLOCK_N, D, IEEE, TMA)
    for c in range(cf, c1):  # the causal edge (and the kv end)
        m, l, acc = _chunk(q, m, l, acc, k_ptr, v_ptr, bt_ptr, req, kvh, c, kv_len, kv_start, qpos, qk_scale,
                           skb, skt, skh, sbt, True, PAGED, PAGE, BLOCK_M, BLOCK_N, D, IEEE, TMA)
    return m, l, acc


@triton.jit
def _merge(M, L, O, m, l, o):
    """(M, L, O) <- (M, L, O) (+) (m, l, o); (-inf, 0, 0) is an exact identity on either side."""
    M_new = tl.maximum(M, m)
    Ms = tl.where(M_new == float("-inf"), 0.0, M_new)
    a = tl.where(M_new == M, 1.0, tl.exp2(M - Ms))
    b = tl.where(M_new == m, 1.0, tl.exp2(m - Ms))
    L = tl.fma(L, a, l * b)
    O = tl.fma(O, a[:, None], o * b[:, None])
    return M_new, L, O


@triton.jit
def _store_lse(lse_ptr, idx, M, L, row_ok):
    """lse = log(sum_j exp(scale * s_j)) = (M + log2 L) * ln 2; L >= 1 on every causal row."""
    tl.store(lse_ptr + idx, (M + tl.log2(L)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def _tile_setup(ql_ptr, qs_ptr, kl_ptr, req, tile, G: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, SEG_CHUNKS: tl.constexpr):
    TOK: tl.constexpr = BLOCK_M // G
    q_len = tl.load(ql_ptr + req)
    q_start = tl.load(qs_ptr + req)
    kv_len = tl.load(kl_ptr + req)
    tok0 = tile * TOK
    first = kv_len - q_len
    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // G
    # a group G that does not divide BLOCK_M (GQA 3, 5, 6, 7) leaves BLOCK_M - TOK * G padding rows: they would hold the
    # next tile's first token, so they are masked (when G divides BLOCK_M the mask is all true: the same rows, bits)
    row_ok = (tok < q_len) & (r < TOK * G)
    tok_c = tl.minimum(tok, q_len - 1)
    qpos = first + tok_c
    pos_min = first + tok0
    pos_max = first + tl.minimum(tok0 + TOK, q_len) - 1
    n_chunks = pos_max // BLOCK_N + 1
    n_full = (pos_min + 1) // BLOCK_N
    n_seg = (n_chunks + SEG_CHUNKS - 1) // SEG_CHUNKS
    return q_len, q_start, kv_len, tok0, row_ok, tok_c, qpos, n_chunks, n_full, n_seg


@triton.jit
def _finish(o_ptr, lse_ptr, qrow, head, d, sot, soh, M, L, O, row_ok, G: tl.constexpr, STORE_LSE: tl.constexpr):
    """out = O / L (IEEE), one cast, stored; and the row's lse when asked."""
    out = tl.div_rn(O, L[:, None])
    tl.store(o_ptr + qrow[:, None] * sot + head[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if STORE_LSE:
        _store_lse(lse_ptr, qrow * (tl.num_programs(2) * G) + head, M, L, row_ok)


@triton.jit(do_not_specialize=["n_tiles", "nseg"])
def _attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, qs_ptr, ql_ptr, kl_ptr, ks_ptr, po_ptr, pml_ptr, lse_ptr,
              sqt, sqh, sot, soh, skb, skt, skh, sbt, qk_scale, n_tiles, nseg,
              G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
              SEG_CHUNKS: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr, PAGE: tl.constexpr,
              IEEE: tl.constexpr, STORE_LSE: tl.constexpr, NESTED: tl.constexpr = False, TMA: tl.constexpr = False,
              kv_rows=0):
    pid0 = tl.program_id(0)
    req = tl.program_id(1)
    kvh = tl.program_id(2)
    if SPLIT:
        tile = n_tiles - 1 - pid0 // nseg
        seg = pid0 % nseg
    else:
        tile = n_tiles - 1 - pid0
        seg = 0
    q_len, q_start, kv_len, tok0, row_ok, tok_c, qpos, n_chunks, n_full, n_seg = _tile_setup(
        ql_ptr, qs_ptr, kl_ptr, req, tile, G, BLOCK_M, BLOCK_N, SEG_CHUNKS)
    if tok0 < q_len:
        kv_start = 0
        if not PAGED:
            kv_start = tl.load(ks_ptr + req)
        r = tl.arange(0, BLOCK_M)
        head = kvh * G + r % G
        d = tl.arange(0, D)
        qrow = (q_start + tok_c).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * sqt + head[:, None] * sqh + d[None, :], mask=row_ok[:, None], other=0.0)
        if TMA:  # packed K / V [kv_rows, Hkv, D] with the heads contiguous in a row (the host checks): 2-D descriptors
            k_src = tl.make_tensor_descriptor(k_ptr, [kv_rows, tl.num_programs(2) * D], [skt, 1], [BLOCK_N, D])
            v_src = tl.make_tensor_descriptor(v_ptr, [kv_rows, tl.num_programs(2) * D], [skt, 1], [BLOCK_N, D])
        else:
            k_src = k_ptr
            v_src = v_ptr
        if SPLIT:
            if seg < n_seg:
                m, l, acc = _segment(q, seg, n_chunks, n_full, k_src, v_src, bt_ptr, req, kvh, kv_len, kv_start, qpos,
                                     qk_scale, skb, skt, skh, sbt, SEG_CHUNKS, PAGED, PAGE, BLOCK_M, BLOCK_N, D, IEEE, TMA)
                hq = tl.num_programs(2) * G
                pidx = (qrow * hq + head) * nseg + seg
                tl.store(po_ptr + pidx[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
                tl.store(pml_ptr + pidx * 2, m, mask=row_ok)
                tl.store(pml_ptr + pidx * 2 + 1, l, mask=row_ok)
        elif NESTED:
            # segment by segment, each a clean chunk loop (_segment), folded in order: the same
            # arithmetic as the flat walk below and as the split programs + combine
            M = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            L = tl.zeros((BLOCK_M,), dtype=tl.float32)
            O = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            for s in range(0, n_seg):
                m, l, acc = _segment(q, s, n_chunks, n_full, k_src, v_src, bt_ptr, req, kvh, kv_len, kv_start, qpos,
                                     qk_scale, skb, skt, skh, sbt, SEG_CHUNKS, PAGED, PAGE, BLOCK_M, BLOCK_N, D, IEEE, TMA)
                M, L, O = _merge(M, L, O, m, l, acc)
            _finish(o_ptr, lse_ptr, qrow, head, d, sot, soh, M, L, O, row_ok, G, STORE_LSE)
        else:
            # one flat walk over the chunks; a finished segment is folded into (M, L, O) at the
            # next segment's first chunk: the same arithmetic as _segment + _merge per segment
            M = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            L = tl.zeros((BLOCK_M,), dtype=tl.float32)
            O = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            if n_seg == 1:  # every key of the tile in segment 0: its chunk loop alone (no fold test inside the
                # loop); the walk below does the same arithmetic there, never folding before the last merge
                m, l, acc = _segment(q, 0, n_chunks, n_full, k_src, v_src, bt_ptr, req, kvh, kv_len, kv_start, qpos,
                                     qk_scale, skb, skt, skh, sbt, SEG_CHUNKS, PAGED, PAGE, BLOCK_M, BLOCK_N, D, IEEE,
                                     TMA)
            else:
                m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
                l = tl.zeros((BLOCK_M,), dtype=tl.float32)
                acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
                for c in range(0, n_full):  # every key visible to every row: no mask
                    if ((c % SEG_CHUNKS) == 0) & (c > 0):
                        M, L, O = _merge(M, L, O, m, l, acc)
                        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
                        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
                        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
                    m, l, acc = _chunk(q, m, l, acc, k_src, v_src, bt_ptr, req, kvh, c, kv_len, kv_start, qpos,
                                       qk_scale, skb, skt, skh, sbt, False, PAGED, PAGE, BLOCK_M, BLOCK_N, D, IEEE, TMA)
                for c in range(n_full, n_chunks):  # the causal edge (and the kv end)
                    if ((c % SEG_CHUNKS) == 0) & (c > 0):
                        M, L, O = _merge(M, L, O, m, l, acc)
                        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
                        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
                        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
                    m, l, acc = _chunk(q, m, l, acc, k_src, v_src, bt_ptr, req, kvh, c, kv_len, kv_start, qpos,
                                       qk_scale, skb, skt, skh, sbt, True, PAGED, PAGE, BLOCK_M, BLOCK_N, D, IEEE, TMA)
            M, L, O = _merge(M, L, O, m, l, acc)
            _finish(o_ptr, lse_ptr, qrow, head, d, sot, soh, M, L, O, row_ok, G, STORE_LSE)


@triton.jit(do_not_specialize=["n_tiles", "nseg"])
def _attn_combine(o_ptr, qs_ptr, ql_ptr, kl_ptr, po_ptr, pml_ptr, lse_ptr, sot, soh, n_tiles, nseg,
                  G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  SEG_CHUNKS: tl.constexpr, STORE_LSE: tl.constexpr):
    req = tl.program_id(1)
    kvh = tl.program_id(2)
    tile = n_tiles - 1 - tl.program_id(0)
    q_len, q_start, kv_len, tok0, row_ok, tok_c, qpos, n_chunks, n_full, n_seg = _tile_setup(
        ql_ptr, qs_ptr, kl_ptr, req, tile, G, BLOCK_M, BLOCK_N, SEG_CHUNKS)
    if tok0 < q_len:
        r = tl.arange(0, BLOCK_M)
        head = kvh * G + r % G
        d = tl.arange(0, D)
        qrow = (q_start + tok_c).to(tl.int64)
        hq = tl.num_programs(2) * G
        M = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        L = tl.zeros((BLOCK_M,), dtype=tl.float32)
        O = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for s in range(0, n_seg):
            pidx = (qrow * hq + head) * nseg + s
            o = tl.load(po_ptr + pidx[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            m = tl.load(pml_ptr + pidx * 2, mask=row_ok, other=float("-inf"))
            l = tl.load(pml_ptr + pidx * 2 + 1, mask=row_ok, other=0.0)
            M, L, O = _merge(M, L, O, m, l, o)
        out = tl.div_rn(O, L[:, None])
        tl.store(o_ptr + qrow[:, None] * sot + head[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        if STORE_LSE:
            _store_lse(lse_ptr, qrow * hq + head, M, L, row_ok)


def _launch(q, k, v, out, bt, q_start, q_len, kv_len, kv_start, n_tiles, max_kv, scale, paged, split, cfg,
            strides_kv, lse=None, walk="flat", gluon=True):
    if walk not in ("flat", "nested"):
        raise ValueError(f"attention: walk must be 'flat' or 'nested', got {walk!r}")
    T, hq, d = q.shape
    hkv = strides_kv[3]
    G = hq // hkv
    if cfg.block_m < G or cfg.seg_keys % cfg.block_n:
        raise ValueError(f"attention: block_m={cfg.block_m} must hold one token's {G} query heads (the GQA group) and "
                         f"seg_keys={cfg.seg_keys} be a multiple of block_n={cfg.block_n}")
    B = q_len.shape[0]
    nseg = cdiv(max(max_kv, 1), cfg.seg_keys)
    if split is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        split = nseg > 1 and n_tiles * B * hkv < 2 * sms
    qk_scale = float(scale) * _LOG2E
    skb, skt, skh = strides_kv[:3]
    common = dict(G=G, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d, SEG_CHUNKS=cfg.seg_keys // cfg.block_n)
    if split:
        po = torch.empty((T, hq, nseg, d), device=q.device, dtype=torch.float32)
        pml = torch.empty((T, hq, nseg, 2), device=q.device, dtype=torch.float32)
    else:
        po = pml = out  # unused
    store_lse = lse is not None
    lse = lse if store_lse else out  # unused
    tma = not paged and _tma_ok(k, v, skh, d)
    if gluon and tma and q.is_cuda and attention_gluon.unsupported_reason(q, k, cfg, G, d, paged=paged, split=split, tma=tma,
                                                                 walk=walk) is None:
        dispatch.note_kernel("attention gluon prefill")
        return attention_gluon.launch(q, k, v, out, q_start, q_len, kv_len, kv_start, n_tiles, scale, cfg, skt,
                                      lse if store_lse else None)
    if tma:
        _ensure_allocator()
    dispatch.note_kernel(lambda: f"attention triton {'paged' if paged else 'packed'}" + (" tma" if tma else "")
                         + (f", split in {nseg}" if split else "") + (f", {walk} walk" if walk != "flat" else ""))
    _attn_fwd_fast[(n_tiles * (nseg if split else 1), B, hkv)](
        q, k, v, out, bt, q_start, q_len, kv_len, kv_start, po, pml, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), skb, skt, skh, bt.stride(0) if paged else 0,
        qk_scale, n_tiles, nseg, PAGED=paged, SPLIT=split, PAGE=cfg.page_size if not paged else k.shape[1],
        IEEE=q.dtype == torch.float32, STORE_LSE=store_lse and not split, NESTED=walk == "nested", TMA=tma,
        kv_rows=k.shape[0] if tma else 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=False, **common)
    if split:
        _attn_combine_fast[(n_tiles, B, hkv)](out, q_start, q_len, kv_len, po, pml, lse, out.stride(0), out.stride(1),
                                         n_tiles, nseg, STORE_LSE=store_lse, num_warps=cfg.num_warps,
                                         enable_fp_fusion=False, **common)
    return out


def _tma_ok(k, v, skh, d) -> bool:
    """Whether packed K / V [rows, Hkv, D] load through 2-D tensor descriptors [rows, Hkv * D]: on CUDA, 16-bit
    dtypes (bf16 / fp16: what was timed and bit-checked on the H200; fp32, a checking mode on the GPU, keeps the pointer
    loads), the heads contiguous in a row (stride D), and the base addresses and the row stride 16-byte aligned (the
    copy engine's rule). Scheduling only: the descriptors load the same values as the pointer loads (session 25's
    sweep, the golden bits and the 1,123,092-token parity: equal bits)."""
    interp = interpreting()
    if not _TMA_ENABLED or not (k.is_cuda or interp):
        return False
    es = k.element_size()  # (the interpreter runs the descriptors at any dtype: the CPU suite checks their indexing)
    return ((es == 2 or interp) and skh == d and k.stride(2) == 1 and v.stride() == k.stride() and k.data_ptr() % 16 == 0
            and v.data_ptr() % 16 == 0 and (k.stride(0) * es) % 16 == 0)


def _check_qkv(q, hkv, d):
    if q.dim() != 3 or q.shape[-1] != d or q.shape[1] % hkv:
        raise ValueError(f"attention: q {tuple(q.shape)} does not fit {hkv} kv heads of dim {d}")
    if not C.attention_head_dim_ok(d):
        raise ValueError(f"rlkernel's Triton attention needs a head_dim that is a power of two >= 16 (64 and 128 are "
                         f"measured), got {d}: this model cannot run the GPU strict contract")
    if q.stride(-1) != 1:
        raise ValueError("attention: q must be contiguous in the head dim")


def attention_varlen(q, k, v, cu_seqlens, *, scale=None, max_seqlen=None, split=None, config=None,
                     return_lse=False, walk="flat"):
    """Causal attention over packed sequences: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1].

    return_lse=True returns (out, lse) with lse float32 [T, Hq] = logsumexp_j(scale * q.k_j) over
    the row's visible keys, natural log (what attention_bwd.attention_varlen_backward takes);
    split and unsplit both store it, with the same bits. `out` is the same either way; lse rows
    outside cu_seqlens[0]:cu_seqlens[-1] are left unwritten.
    """
    cfg = config or C.ATTENTION
    _check_qkv(q, k.shape[1], k.shape[2])
    if k.stride() != v.stride() or k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    q_start = cu[:-1].contiguous()
    q_len = (cu[1:] - cu[:-1]).contiguous()
    if max_seqlen is None:
        max_seqlen = int(q_len.max()) if q_len.numel() else 0
    elif q_len.numel():  # the caller's bound sizes the grid: a shorter one would leave rows unwritten
        torch._assert_async((q_len <= max_seqlen).all(), "attention_varlen: a sequence is longer than max_seqlen")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=q.device, dtype=torch.float32) if return_lse else None
    if max_seqlen == 0:
        return (out, lse) if return_lse else out
    n_tiles = cdiv(max_seqlen, cfg.block_m // (q.shape[1] // k.shape[1]))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _launch(q, k, v, out, q_start, q_start, q_len, q_len, q_start, n_tiles, max_seqlen, scale, False, split,
            cfg, (0, k.stride(0), k.stride(1), k.shape[1]), lse, walk=walk)
    return (out, lse) if return_lse else out


def attention_pieces(q, k, v, q_start, q_len, kv_start, kv_len, *, max_query_len, max_kv_len, scale=None, config=None,
                     return_lse=False):
    """Queries against packed keys: request b's rows q[q_start[b] : q_start[b] + q_len[b]] are the last q_len[b] of its
    kv_len[b] positions, whose keys and values are k / v rows kv_start[b] .. kv_start[b] + kv_len[b] - 1 — context
    parallelism's pieces (a rank's queries against the gathered stream, rlkernel.parallel.context_parallel). The packed
    kernel (K / V through TMA where they load so), chunks anchored at each request's first key: the bits of
    attention_paged on the same keys (and of attention_varlen where q_len == kv_len). The Gluon prefill is not used:
    its first-use check covers q_len == kv_len only. int32 index tensors on q's device; max_query_len / max_kv_len: the
    host's bounds (no read-back). return_lse: also lse float32 [T, Hq] (rows outside the pieces unwritten)."""
    cfg = config or C.ATTENTION
    _check_qkv(q, k.shape[1], k.shape[2])
    if k.stride() != v.stride() or k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=q.device, dtype=torch.float32) if return_lse else None
    if max_query_len > 0:
        n_tiles = cdiv(max_query_len, cfg.block_m // (q.shape[1] // k.shape[1]))
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        _launch(q, k, v, out, q_start, q_start, q_len, kv_len, kv_start, n_tiles, max_kv_len, scale, False, None, cfg,
                (0, k.stride(0), k.stride(1), k.shape[1]), lse, gluon=False)
    return (out, lse) if return_lse else out


def attention_paged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None,
                    max_query_len=None, max_seq_len=None, split=None, config=None, walk="flat"):
    """Queries against a paged KV cache [num_blocks, block_size, Hkv, D] (decode, chunked prefill).

    Request b owns q rows query_start_loc[b]:query_start_loc[b+1], the last tokens of its
    seq_lens[b]-token sequence (their keys already in the cache); block_tables [B, max_blocks].
    """
    cfg = config or C.ATTENTION
    _check_qkv(q, k_cache.shape[2], k_cache.shape[3])
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("attention_paged: k/v caches must share strides, head dim contiguous")
    qsl = query_start_loc.to(device=q.device, dtype=torch.int32)
    q_start = qsl[:-1].contiguous()
    q_len = (qsl[1:] - qsl[:-1]).contiguous()
    kv_len = seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    bt = block_tables.to(device=q.device, dtype=torch.int32)
    if max_query_len is None:
        max_query_len = int(q_len.max()) if q_len.numel() else 0
    if max_seq_len is None:
        max_seq_len = int(kv_len.max()) if kv_len.numel() else 0
    out = torch.empty_like(q)
    if max_query_len == 0:
        return out
    n_tiles = cdiv(max_query_len, cfg.block_m // (q.shape[1] // k_cache.shape[2]))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _launch(q, k_cache, v_cache, out, bt, q_start, q_len, kv_len, q_start, n_tiles, max_seq_len, scale, True,
                   split, cfg, (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[2]), walk=walk)


@triton.jit(do_not_specialize=["n_tok"])
def _write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_tok, skt, skh, svt, svh, scb, sco, sch, svb, svo, svhh,
              BS: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HKV_P2: tl.constexpr, D_P2: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # vLLM's padding slots (PAD_SLOT_ID = -1) are skipped on the device
        blk = slot // BS
        off = slot % BS
        h = tl.arange(0, HKV_P2)[:, None]  # padded to powers of two (tl.arange), the padding masked off
        d = tl.arange(0, D_P2)[None, :]
        m = (h < HKV) & (d < D)
        kx = tl.load(k_ptr + t * skt + h * skh + d, mask=m)
        vx = tl.load(v_ptr + t * svt + h * svh + d, mask=m)
        tl.store(kc_ptr + blk * scb + off * sco + h * sch + d, kx.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + blk * svb + off * svo + h * svhh + d, vx.to(vc_ptr.dtype.element_ty), mask=m)


def write_kv_supported(k, v, k_cache, v_cache) -> bool:
    """Whether the kernel takes this layout: contiguous head dims (any Hkv and D: the kernel pads them to powers of
    two and masks the padding, so SmolLM2's 3 KV heads write without the indexed copy's host sync, which a CUDA
    graph capture refuses)."""
    return k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Exact copies of k/v [T, Hkv, D] into the caches [blocks, block_size, Hkv, D] at flat
    slots; negative slots skipped. One program per token, no host sync (the slot test runs on
    the device), any cache strides; layouts per `write_kv_supported` (rk.write_kv_cache takes
    the others by indexed copies)."""
    n = slot_mapping.shape[0]
    hkv, d = k.shape[1], k.shape[2]
    if not write_kv_supported(k, v, k_cache, v_cache):
        raise ValueError("write_kv_cache: head dims must be contiguous")
    if n == 0:
        return
    _write_kv_fast[(n,)](k, v, k_cache, v_cache, slot_mapping, n, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
                    v_cache.stride(2), BS=k_cache.shape[1], HKV=hkv, D=d, HKV_P2=next_pow2(hkv),
                    D_P2=next_pow2(d), num_warps=4)


__all__ = ["attention_varlen", "attention_pieces", "attention_paged", "write_kv_cache"]

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_attn_fwd_fast = fast(_attn_fwd)
_attn_combine_fast = fast(_attn_combine)
_write_kv_fast = fast(_write_kv)

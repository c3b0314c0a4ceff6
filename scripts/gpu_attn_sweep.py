#!/usr/bin/env python3
"""Where the strict attention prefill's time goes: variants of its kernel, bit-checked and timed against SDPA.

    python3 scripts/gpu_attn_sweep.py [--out DIR] [--quick]

Why: issue 10 asks attention prefill >= 0.85x SDPA / FlashAttention; the contract's Triton kernel runs at 0.56-0.60x
(8 x 4,096 causal, 32 q heads / 8 kv heads, head dim 128), and bigger query tiles did not help it (run 6: 64 x 64 w4
361 TFLOP/s, 128 x 64 w8 337). This script asks which of the kernel's own features costs what, one at a time, in a
variant kernel (`_var_fwd`, packed varlen prefill only) whose every knob keeps the production kernel's arithmetic:

  TMA        K / V tiles through tensor descriptors (the bulk copy engine) instead of masked pointer loads; rows past
             a sequence's end are then another sequence's keys (or TMA's zeros past the buffer), which the causal mask
             turns into p == 0 exactly, as the production kernel's zero rows are;
  NOLOADMASK the chunks every row of a tile sees in full load without a row mask (they never pass kv_len);
  PLAINALPHA alpha = exp2(m - m_safe) without the production's where(m_new == m, 1, ...) (exp2(0) == 1 exactly, and
             where m stays -inf the state it scales is zero either way);
  ONESEG     when every key of every sequence lies in one segment (max_seqlen <= seg_keys), the segment's (m, l, acc)
             are the row's state and the (M, L, O) accumulator of the merge walk is never live; the final merge with
             the identity is applied once (so a -0.0 is rounded the way the merge rounds it);
  NESTED     segments as an outer loop (no branch inside the chunk loop), as production's walk="nested".
and the tile (block_m rows, num_warps, num_stages). Every variant is compared with torch.equal against the production
kernel (`attention.attention_varlen`) run at the same contract tiles (block_n, seg_keys); block_m and the warps
are scheduling (each row's q.k and p.v are the same wgmma k16 chains, so decode at block_m 64 gives the same bits) --
the bit check says whether that holds. Variants that change the contract itself (block_n 128, seg_keys 4,096) are
compared with production at those tiles and marked `contract_change`.

Writes DIR/h200_attn_sweep.json (DIR: $OUT, else benchmarks/). Without CUDA: {"skipped": reason}, exit 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


try:  # the kernels are defined where Triton imports (a CPU machine may lack it: main() then writes "skipped")
    import triton
    import triton.language as tl
    from rlkernel.backends.triton.attention import _finish, _merge, _tile_setup
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    @triton.jit
    def _vchunk(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, c, kv_len, kv_start, qpos, qk_scale, skt, kcol,
                MASK: tl.constexpr, TMA: tl.constexpr, LOADMASK: tl.constexpr, ALPHA_WHERE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
        kpos = c * BLOCK_N + tl.arange(0, BLOCK_N)
        if TMA:
            k = k_desc.load([kv_start + c * BLOCK_N, kcol])
            v = v_desc.load([kv_start + c * BLOCK_N, kcol])
        else:
            d = tl.arange(0, D)
            off = (kv_start + kpos).to(tl.int64)[:, None] * skt + kcol + d[None, :]
            if MASK or LOADMASK:
                valid = kpos < kv_len
                k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
                v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
            else:
                k = tl.load(k_ptr + off)
                v = tl.load(v_ptr + off)
        s = tl.dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
        if MASK:
            s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if ALPHA_WHERE:
            alpha = tl.where(m_new == m, 1.0, tl.exp2(m - m_safe))
        else:
            alpha = tl.exp2(m - m_safe)
        p = tl.exp2(tl.fma(s, qk_scale, -m_safe[:, None]))
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        return m_new, l, acc

    @triton.jit
    def _var_fwd(q_ptr, k_ptr, v_ptr, o_ptr, qs_ptr, ql_ptr, k_desc, v_desc, sqt, sqh, sot, soh, skt, skh, qk_scale,
                 n_tiles, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                 SEG_CHUNKS: tl.constexpr, TMA: tl.constexpr, LOADMASK: tl.constexpr, ALPHA_WHERE: tl.constexpr,
                 ONESEG: tl.constexpr, NESTED: tl.constexpr):
        req = tl.program_id(1)
        kvh = tl.program_id(2)
        tile = n_tiles - 1 - tl.program_id(0)
        q_len, q_start, kv_len, tok0, row_ok, tok_c, qpos, n_chunks, n_full, n_seg = _tile_setup(
            ql_ptr, qs_ptr, ql_ptr, req, tile, G, BLOCK_M, BLOCK_N, SEG_CHUNKS)
        if tok0 < q_len:
            kv_start = q_start
            r = tl.arange(0, BLOCK_M)
            head = kvh * G + r % G
            d = tl.arange(0, D)
            qrow = (q_start + tok_c).to(tl.int64)
            q = tl.load(q_ptr + qrow[:, None] * sqt + head[:, None] * sqh + d[None, :], mask=row_ok[:, None],
                        other=0.0)
            kcol = kvh * skh
            M = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            L = tl.zeros((BLOCK_M,), dtype=tl.float32)
            O = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            if ONESEG:
                for c in range(0, n_full):
                    m, l, acc = _vchunk(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, c, kv_len, kv_start, qpos,
                                        qk_scale, skt, kcol, False, TMA, LOADMASK, ALPHA_WHERE, BLOCK_M, BLOCK_N, D)
                for c in range(n_full, n_chunks):
                    m, l, acc = _vchunk(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, c, kv_len, kv_start, qpos,
                                        qk_scale, skt, kcol, True, TMA, LOADMASK, ALPHA_WHERE, BLOCK_M, BLOCK_N, D)
            elif NESTED:
                for sg in range(0, n_seg):
                    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
                    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
                    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
                    c0 = sg * SEG_CHUNKS
                    c1 = tl.minimum(c0 + SEG_CHUNKS, n_chunks)
                    cf = tl.minimum(tl.maximum(n_full, c0), c1)
                    for c in range(c0, cf):
                        m, l, acc = _vchunk(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, c, kv_len, kv_start, qpos,
                                            qk_scale, skt, kcol, False, TMA, LOADMASK, ALPHA_WHERE, BLOCK_M, BLOCK_N, D)
                    for c in range(cf, c1):
                        m, l, acc = _vchunk(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, c, kv_len, kv_start, qpos,
                                            qk_scale, skt, kcol, True, TMA, LOADMASK, ALPHA_WHERE, BLOCK_M, BLOCK_N, D)
                    if sg < n_seg - 1:
                        M, L, O = _merge(M, L, O, m, l, acc)
            else:
                for c in range(0, n_full):
                    if ((c % SEG_CHUNKS) == 0) & (c > 0):
                        M, L, O = _merge(M, L, O, m, l, acc)
                        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
                        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
                        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
                    m, l, acc = _vchunk(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, c, kv_len, kv_start, qpos,
                                        qk_scale, skt, kcol, False, TMA, LOADMASK, ALPHA_WHERE, BLOCK_M, BLOCK_N, D)
                for c in range(n_full, n_chunks):
                    if ((c % SEG_CHUNKS) == 0) & (c > 0):
                        M, L, O = _merge(M, L, O, m, l, acc)
                        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
                        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
                        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
                    m, l, acc = _vchunk(q, m, l, acc, k_ptr, v_ptr, k_desc, v_desc, c, kv_len, kv_start, qpos,
                                        qk_scale, skt, kcol, True, TMA, LOADMASK, ALPHA_WHERE, BLOCK_M, BLOCK_N, D)
            M, L, O = _merge(M, L, O, m, l, acc)
            _finish(o_ptr, o_ptr, qrow, head, d, sot, soh, M, L, O, row_ok, G, False)



def variant_call(kern, q, k, v, cu, max_seqlen, *, block_m=64, block_n=64, seg_keys=512, warps=4, stages=3,
                 tma=True, loadmask=False, alpha_where=False, oneseg=None, nested=False, info=None):
    """The variant kernel over packed sequences (self-attention: kv rows are the q rows), production's grid."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor
    T, hq, d = q.shape
    hkv = k.shape[1]
    G = hq // hkv
    if oneseg is None:
        oneseg = max_seqlen <= seg_keys
    if oneseg and max_seqlen > seg_keys:
        raise ValueError("oneseg needs every sequence within one segment")
    cu32 = cu.to(torch.int32)
    q_start = cu32[:-1].contiguous()
    q_len = (cu32[1:] - cu32[:-1]).contiguous()
    out = torch.empty_like(q)
    k2, v2 = k.view(T, hkv * d), v.view(T, hkv * d)
    kd = TensorDescriptor.from_tensor(k2, [block_n, d]) if tma else k2
    vd = TensorDescriptor.from_tensor(v2, [block_n, d]) if tma else v2
    n_tiles = -(-max_seqlen // (block_m // G))
    ck = kern[(n_tiles, q_len.shape[0], hkv)](
        q, k2, v2, out, q_start, q_len, kd, vd, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k2.stride(0), d, float(d ** -0.5) * 1.4426950408889634, n_tiles, G=G, BLOCK_M=block_m, BLOCK_N=block_n, D=d,
        SEG_CHUNKS=seg_keys // block_n, TMA=tma, LOADMASK=loadmask, ALPHA_WHERE=alpha_where, ONESEG=oneseg,
        NESTED=nested, num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    if info is not None and ck is not None:
        info.update(n_regs=getattr(ck, "n_regs", None), n_spills=getattr(ck, "n_spills", None))
    return out


# name -> variant kwargs; production's own arithmetic first (pointer loads with row masks, alpha's where, flat walk)
VARIANTS = {
    "prodlike": dict(tma=False, loadmask=True, alpha_where=True, oneseg=False),
    "noloadmask": dict(tma=False, loadmask=False, alpha_where=True, oneseg=False),
    "plainalpha": dict(tma=False, loadmask=True, alpha_where=False, oneseg=False),
    "tma": dict(tma=True, alpha_where=True, oneseg=False),
    "tma_plain": dict(tma=True, alpha_where=False, oneseg=False),
    "tma_plain_nested": dict(tma=True, alpha_where=False, oneseg=False, nested=True),
    "tma_plain_s2": dict(tma=True, alpha_where=False, oneseg=False, stages=2),
    "tma_plain_s4": dict(tma=True, alpha_where=False, oneseg=False, stages=4),
    "tma_plain_m128w8": dict(tma=True, alpha_where=False, oneseg=False, block_m=128, warps=8),
    "tma_plain_m128w8_s2": dict(tma=True, alpha_where=False, oneseg=False, block_m=128, warps=8, stages=2),
    "tma_plain_m128w8_nested": dict(tma=True, alpha_where=False, oneseg=False, block_m=128, warps=8, nested=True),
    # the (M, L, O) accumulator's cost: no segments at all (a contract with one segment per sequence at this length)
    "seg4096_oneseg_tma": dict(tma=True, alpha_where=False, seg_keys=4096, oneseg=True),
    "seg4096_oneseg_tma_m128w8": dict(tma=True, alpha_where=False, seg_keys=4096, oneseg=True, block_m=128, warps=8),
    "seg4096_oneseg_tma_m128w8_s2": dict(tma=True, alpha_where=False, seg_keys=4096, oneseg=True, block_m=128, warps=8,
                                         stages=2),
    "seg4096_oneseg_ptr": dict(tma=False, loadmask=True, alpha_where=True, seg_keys=4096, oneseg=True),
    # the chunk: 128 keys per online-softmax step
    "n128_tma_m128w8": dict(tma=True, alpha_where=False, oneseg=False, block_m=128, block_n=128, warps=8),
    "n128_seg4096_oneseg_tma_m128w8": dict(tma=True, alpha_where=False, seg_keys=4096, oneseg=True, block_m=128,
                                           block_n=128, warps=8),
}
QUICK = ("prodlike", "tma_plain", "tma_plain_m128w8", "seg4096_oneseg_tma_m128w8")

# --contracts: the production kernels at candidate attention tiles (block_n, seg_keys); prefill also at 128-row tiles
CONTRACTS = [(64, 512), (64, 1024), (64, 2048), (64, 4096), (128, 1024), (128, 2048), (128, 4096)]


def contracts(res, bench, log, dev="cuda", div=1):
    """Production attention at each candidate (block_n, seg_keys): prefill TFLOP/s (8 x 4,096, the 8B and 0.6B head
    counts; 64 x 64 w4 and 128-row w8 tiles), decode latency (paged, shuffled pages, split as production picks it) at
    batch 1 / 8 / 64, and the bit properties: descriptors == pointer loads, decode == prefill rows, 128-row tiles ==
    64-row tiles."""
    import torch
    import torch.nn.functional as F
    from rlkernel.backends.triton import attention as A
    from rlkernel.backends.triton import contracts as C
    out = res["contracts"] = {}
    torch.manual_seed(1)
    # bits: a packed batch of mixed lengths, 8B heads
    lens = [max(1, n // div) for n in (4096, 77, 1000, 2049, 513, 511, 3333, 1, 2600)]
    T, hq, hkv, d = sum(lens), 32, 8, 128
    q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    page = 16
    nblk = sum(-(-n // page) for n in lens) + 4
    perm = torch.randperm(nblk, device=dev)
    kc = torch.zeros(nblk, page, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    bt = torch.zeros(len(lens), max(-(-n // page) for n in lens), dtype=torch.int32, device=dev)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // page)
        bt[i, :nb] = perm[used:used + nb].int()
        used += nb
        pos = torch.arange(n, device=dev)
        A.write_kv_cache(k[int(cu[i]):int(cu[i]) + n], v[int(cu[i]):int(cu[i]) + n], kc, vc,
                         bt[i, pos // page].long() * page + pos % page)
    last = (cu[1:] - 1).long()
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=dev)
    for bn, sk in CONTRACTS:
        cfg = replace(C.ATTENTION, block_n=bn, seg_keys=sk)
        row = out[f"n{bn}_seg{sk}"] = {"block_n": bn, "seg_keys": sk}
        try:
            full = A.attention_varlen(q, k, v, cu, max_seqlen=max(lens), config=cfg)
            with A.tma_off():
                ptr = A.attention_varlen(q, k, v, cu, max_seqlen=max(lens), config=cfg)
            row["tma_equal_pointer"] = bool(torch.equal(full, ptr))
            row["split_equal"] = bool(torch.equal(full, A.attention_varlen(q, k, v, cu, max_seqlen=max(lens), config=cfg,
                                                                           split=True)))
            big = replace(cfg, block_m=128, num_warps=8)
            row["m128w8_equal_m64w4"] = bool(torch.equal(full, A.attention_varlen(q, k, v, cu, max_seqlen=max(lens),
                                                                                  config=big)))
            for split in (False, True):
                od = A.attention_paged(q[last], kc, vc, bt, sl, qsl, config=cfg, split=split, max_query_len=1,
                                       max_seq_len=max(lens))
                row[f"decode_equal_prefill_split{int(split)}"] = bool(torch.equal(od, full[last]))
        except Exception as e:
            row["bits_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log("bits", row)
    del q, k, v, kc, vc
    # prefill timing
    for cname, hq in (("q8b", 32), ("q06", 16)):
        B, L = 8, 4096 // div
        q = torch.randn(B * L, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B * L, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=dev)
        flops = 4 * B * hq * L * L * d / 2
        qb, kb, vb = (x.view(B, L, -1, d).transpose(1, 2) for x in (q, k, v))
        t = bench(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True))
        base = out.setdefault("prefill_sdpa_default", {})
        base[cname] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1)}
        for bn, sk in CONTRACTS:
            row = out[f"n{bn}_seg{sk}"]
            for tname, over in (("m64w4", {}), ("m128w8", dict(block_m=128, num_warps=8))):
                cfg = replace(C.ATTENTION, block_n=bn, seg_keys=sk, **over)
                try:
                    ts = bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L, config=cfg))
                    row[f"prefill_{cname}_{tname}_tflops"] = round(flops / ts / 1e9, 1)
                    row[f"prefill_{cname}_{tname}_ratio_sdpa"] = round(t / ts, 3)
                except Exception as e:
                    row[f"prefill_{cname}_{tname}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if bn == 64 and sk == 512:
                with A.tma_off():
                    ts = bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L, config=cfg))
                row[f"prefill_{cname}_m64w4_pointer_tflops"] = round(flops / ts / 1e9, 1)
            log("prefill", cname, bn, sk, {kk: vv for kk, vv in row.items() if kk.startswith(f"prefill_{cname}")})
        del q, k, v, qb, kb, vb
    # decode timing: 8B heads, shuffled pages
    for nb, ctx in ((1, 4096 // div), (8, 4096 // div), (64, 4096 // div), (8, 1024 // div), (256, 1024 // div)):
        kc = torch.randn(nb * ctx // 16 + 8, 16, hkv, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        perm = torch.randperm(kc.shape[0], device=dev)[: nb * ctx // 16].view(nb, ctx // 16).int()
        qd = torch.randn(nb, 32, d, device=dev, dtype=torch.bfloat16)
        sl = torch.full((nb,), ctx, dtype=torch.int32, device=dev)
        qsl = torch.arange(nb + 1, dtype=torch.int32, device=dev)
        kcont = kc[perm.long()].view(nb, ctx, hkv, d).transpose(1, 2)
        vcont = vc[perm.long()].view(nb, ctx, hkv, d).transpose(1, 2)
        tn = bench(lambda: F.scaled_dot_product_attention(qd[:, :, None], kcont, vcont, enable_gqa=True))
        out.setdefault("decode_sdpa_contiguous_us", {})[f"b{nb}_ctx{ctx}"] = round(tn * 1e3, 1)
        for bn, sk in CONTRACTS:
            cfg = replace(C.ATTENTION, block_n=bn, seg_keys=sk)
            ts = bench(lambda: A.attention_paged(qd, kc, vc, perm, sl, qsl, config=cfg, max_query_len=1,
                                                 max_seq_len=ctx))
            out[f"n{bn}_seg{sk}"][f"decode_b{nb}_ctx{ctx}_us"] = round(ts * 1e3, 1)
            out[f"n{bn}_seg{sk}"][f"decode_b{nb}_ctx{ctx}_vs_sdpa"] = round(ts / tn, 3)
        log("decode", nb, ctx, {f"n{bn}_seg{sk}": out[f"n{bn}_seg{sk}"][f"decode_b{nb}_ctx{ctx}_us"]
                                for bn, sk in CONTRACTS}, "sdpa", round(tn * 1e3, 1))
        del kc, vc, kcont, vcont


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--quick", action="store_true", help="four variants only")
    ap.add_argument("--contracts", action="store_true", help="only the production kernels at candidate tiles")
    args = ap.parse_args()
    out_path = Path(args.out) / "h200_attn_sweep.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        out_path.write_text(json.dumps({"skipped": "no CUDA device"}) + "\n")
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    import torch.nn.functional as F
    import triton
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from rlkernel.backends.triton import attention as A
    from rlkernel.backends.triton import contracts as C

    torch.manual_seed(0)
    kern = _var_fwd
    dev = "cuda"
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "timer": "triton.testing.do_bench (L2 flushed), median ms; TFLOP/s = causal FLOPs 2*2*B*Hq*L*L*D/2",
           "contract_tiles": C.as_dict(C.ATTENTION) if hasattr(C, "as_dict") else str(C.ATTENTION), "cases": {}}

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=60)

    if args.contracts:
        contracts(res, bench, log)
        res["seconds"] = round(time.time() - T0, 1)
        out_path = out_path.with_name("h200_attn_contracts.json")
        out_path.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({"attn_contracts": {k: {kk: vv for kk, vv in v.items() if "q8b_m64w4_ratio" in kk or
                                                  "equal" in kk} for k, v in res["contracts"].items()
                                              if k.startswith("n")}}))
        return 0
    cases = {  # name -> (lengths, hq, hkv, d)
        "q8b_8x4096": ([4096] * 8, 32, 8, 128),
        "q8b_varlen_bits": ([4096, 77, 1000, 2049, 513, 511, 3333, 1], 32, 8, 128),
        "q06_8x4096": ([4096] * 8, 16, 8, 128),
    }
    if args.quick:
        cases.pop("q06_8x4096")
    for cname, (lens, hq, hkv, d) in cases.items():
        T = sum(lens)
        L = max(lens)
        q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        flops = sum(4 * hq * n * n * d / 2 for n in lens)
        timed = cname != "q8b_varlen_bits"
        row = res["cases"][cname] = {"lengths": lens, "hq": hq, "hkv": hkv, "d": d, "variants": {}}
        prod = {}

        def prod_out(block_n, seg_keys, walk="flat"):
            key = (block_n, seg_keys, walk)
            if key not in prod:
                cfg = replace(C.ATTENTION, block_n=block_n, seg_keys=seg_keys)
                prod[key] = A.attention_varlen(q, k, v, cu, max_seqlen=L, config=cfg, split=False, walk=walk)
            return prod[key]

        if timed:
            t = bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L))
            row["production_ms"] = round(t, 4)
            row["production_tflops"] = round(flops / t / 1e9, 1)
            t = bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L, walk="nested"))
            row["production_nested_ms"] = round(t, 4)
            if len(set(lens)) == 1:
                B = len(lens)
                qb, kb, vb = (x.view(B, L, -1, d).transpose(1, 2) for x in (q, k, v))
                for bname, be in (("sdpa_default", None), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                  ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        if be is None:
                            fn = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
                        else:
                            def fn(be=be):
                                with sdpa_kernel(be):
                                    return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
                        t = bench(fn)
                        row[bname + "_ms"] = round(t, 4)
                        row[bname + "_tflops"] = round(flops / t / 1e9, 1)
                    except Exception as e:  # a backend this build lacks: recorded
                        row[bname + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(cname, {kk: vv for kk, vv in row.items() if kk != "variants"})
        names = QUICK if args.quick else list(VARIANTS)
        for name in names:
            kw = dict(VARIANTS[name])
            bn, sk = kw.get("block_n", 64), kw.get("seg_keys", 512)
            if kw.get("oneseg") and L > sk:
                continue
            rec = row["variants"][name] = {"kwargs": kw, "contract_change": (bn, sk) != (64, 512)}
            try:
                info = {}
                y = variant_call(kern, q, k, v, cu, L, info=info, **kw)
                torch.cuda.synchronize()
                ref = prod_out(bn, sk)
                rec["equal_production"] = bool(torch.equal(y, ref))
                if not rec["equal_production"]:
                    diff = (y.float() - ref.float()).abs()
                    rec["rows_differ"] = int((diff.amax(dim=(1, 2)) > 0).sum())
                    rec["max_abs_diff"] = float(diff.max())
                rec.update(info)
                if timed:
                    t = bench(lambda: variant_call(kern, q, k, v, cu, L, **kw))
                    rec["ms"] = round(t, 4)
                    rec["tflops"] = round(flops / t / 1e9, 1)
                    rec["vs_production"] = round(row["production_ms"] / t, 3)
                    for bname in ("sdpa_default", "sdpa_cudnn", "sdpa_flash"):
                        if bname + "_ms" in row:
                            rec[f"ratio_{bname}"] = round(row[bname + "_ms"] / t, 3)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(cname, name, {kk: vv for kk, vv in rec.items() if kk != "kwargs"})
        del q, k, v
        torch.cuda.empty_cache()
    res["seconds"] = round(time.time() - T0, 1)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    summary = {c: {n: (r.get("tflops"), r.get("equal_production")) for n, r in row["variants"].items()}
               for c, row in res["cases"].items()}
    print(json.dumps({"attn_sweep": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

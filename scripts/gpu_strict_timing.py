#!/usr/bin/env python3
"""What the GPU strict path costs: the timing sections of `scripts/gpu_strict_parity.py` (`--only timing,train,sweep`).

  timing   strict / native ratios in this process: GEMM vs cuBLAS, attention prefill vs SDPA,
           decode step (64 sequences), scoring forward
  train    forward + backward of the layer stack, strict / native
  sweep    candidate tile configs

They run in gpu_strict_parity's process, on its model and at its `--dims` (its QWEN3_8B, DEV, log and timer);
gpu_strict_parity.py's docstring describes the harness. Not a script of its own.
"""
from __future__ import annotations

import json

from gpu_strict_parity import DEV, GEMMS, QWEN3_8B, _recorded, bench, log  # noqa: F401  (the running harness's own)


def top_kernels(fn, n=15):
    """CUDA time by kernel name for one call of fn (where the strict path spends its time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))
    return [{"kernel": e.key[:80], "calls": e.count, "ms": round(getattr(e, "device_time_total", 0) / 1e3, 3)}
            for e in rows[:n]]


def timing(args, res, model):
    import torch
    import torch.nn.functional as F
    import rlkernel as rk
    from rlkernel.backends.triton import attention as A
    from rlkernel.backends.triton import gemm
    from gpu_gemm_sweep import chain_ms
    out = {"gemm": {}, "gemm_timers": {"bench": "do_bench, L2 flushed before every call, median (*_ms, ratio_tflops)",
                                       "chain": "a CUDA graph of 8 calls on 8 distinct weights, replayed (*_chain_ms, "
                                                "ratio_chain): no host cost, no flush kernel; up to 2^40 multiply-adds"}}
    for name, (k, n) in GEMMS.items():
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(8)]
        w = ws[0]
        for m in (1, 16, 256, 1024, 4096, 16384):
            a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            t_s = bench(lambda: gemm.matmul(a, w))
            t_n = bench(lambda: F.linear(a, w))
            row = out["gemm"][f"{name}_M{m}"] = {"strict_ms": round(t_s, 4), "cublas_ms": round(t_n, 4),
                                                "strict_tflops": round(2 * m * n * k / t_s / 1e9, 1),
                                                "ratio_tflops": round(t_n / t_s, 3)}
            if m * n * k <= 2 ** 40:
                c_s = chain_ms(lambda i: gemm.matmul(a, ws[i]))
                c_n = chain_ms(lambda i: F.linear(a, ws[i]))
                row.update(strict_chain_ms=round(c_s, 4), cublas_chain_ms=round(c_n, 4),
                           strict_chain_tflops=round(2 * m * n * k / c_s / 1e9, 1), ratio_chain=round(c_n / c_s, 3))
            if name in ("o", "down"):  # the row-parallel layers: 4 canonical K segments, each schedule
                for sc in gemm.SCHEDULES:
                    out["gemm"][f"{name}_M{m}"][f"segments4_{sc}_ratio"] = _recorded(
                        lambda: round(t_n / bench(lambda: gemm.matmul(a, w, k_segments=4, schedule=sc)), 3))
        del w, ws
    log("gemm:", json.dumps(out["gemm"]))
    # attention prefill: 8 x 4096 causal, 32 q heads / 8 kv heads, D=128
    B, L = 8, 4096
    q = torch.randn(B * L, 32, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(B * L, 8, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=DEV)
    t_s = bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L))
    qb, kb, vb = (x.view(B, L, -1, 128).transpose(1, 2) for x in (q, k, v))
    t_n = bench(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True))
    flops = 4 * B * 32 * L * L * 128 / 2
    out["attention_prefill_8x4096"] = {"strict_ms": round(t_s, 3), "sdpa_ms": round(t_n, 3),
                                       "strict_tflops": round(flops / t_s / 1e9, 1),
                                       "sdpa_tflops": round(flops / t_n / 1e9, 1), "ratio": round(t_n / t_s, 3)}
    log("prefill:", out["attention_prefill_8x4096"])
    # decode attention alone, batch 64, context 4096 (paged, shuffled pages) vs SDPA on contiguous KV
    nb, ctx = 64, 4096
    kc = torch.randn(nb * ctx // 16 + 8, 16, 8, 128, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    perm = torch.randperm(kc.shape[0], device=DEV)[: nb * ctx // 16].view(nb, ctx // 16).int()
    qd = torch.randn(nb, 32, 128, device=DEV, dtype=torch.bfloat16)
    sl = torch.full((nb,), ctx, dtype=torch.int32, device=DEV)
    qsl = torch.arange(nb + 1, dtype=torch.int32, device=DEV)
    t_s = bench(lambda: A.attention_paged(qd, kc, vc, perm, sl, qsl, max_query_len=1, max_seq_len=ctx))
    kcont = kc[perm.long()].view(nb, ctx, 8, 128).transpose(1, 2)
    vcont = vc[perm.long()].view(nb, ctx, 8, 128).transpose(1, 2)
    t_n = bench(lambda: F.scaled_dot_product_attention(qd[:, :, None], kcont, vcont, enable_gqa=True))
    out["attention_decode_b64_ctx4096"] = {"strict_us": round(t_s * 1e3, 1), "sdpa_contiguous_us": round(t_n * 1e3, 1),
                                           "ratio_latency": round(t_s / t_n, 3)}
    log("decode attn:", out["attention_decode_b64_ctx4096"])
    del q, k, v, kc, vc, kcont, vcont
    # model-level: decode step for 64 sequences at context 2048, scoring forward 8 x 2048
    out.update(model_timing(args, model))
    res["timing"] = out


def _sdpa_attend(B, L):
    import torch.nn.functional as F

    def attend(layer, q, k, v):
        qb, kb, vb = (x.view(B, L, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(B * L, q.shape[1], q.shape[2])
    return attend


def model_timing(args, model):
    import torch
    import torch.nn.functional as F
    import rlkernel as rk
    out = {}
    B, L = 8, 2048
    ids = torch.randint(0, QWEN3_8B["vocab_size"], (B * L,), device=DEV)
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=DEV)
    pos = torch.arange(L, device=DEV).repeat(B)
    tg = torch.randint(0, QWEN3_8B["vocab_size"], (B * L,), device=DEV)

    def strict_score():
        with torch.no_grad():
            return model.logprobs(model.forward_packed(ids, cu), tg)

    def native_score():
        with torch.no_grad(), rk.mode("native"):
            h = model.hidden_states(ids, pos, _sdpa_attend(B, L))
            return torch.log_softmax(F.linear(h, model.lm_head_weight).float(), -1).gather(1, tg[:, None])[:, 0]

    t_s, t_n = bench(strict_score, 200), bench(native_score, 200)
    out["scoring_forward_8x2048"] = {"layers": args.layers, "strict_ms": round(t_s, 2), "native_ms": round(t_n, 2),
                                     "ratio_time": round(t_s / t_n, 3)}
    log("scoring:", out["scoring_forward_8x2048"])
    # decode step: 64 sequences at context 2048; strict = paged cache + our kernels,
    # native = production ops with a contiguous KV cache and SDPA (an HF-style engine)
    nb, ctx = 64, 2048
    hkv, d = QWEN3_8B["num_kv_heads"], QWEN3_8B["head_dim"]
    kc = [torch.randn(nb * ctx // 16 + 64, 16, hkv, d, device=DEV, dtype=torch.bfloat16) for _ in range(args.layers)]
    vc = [torch.randn_like(x) for x in kc]
    bt = torch.randperm(kc[0].shape[0], device=DEV)[: nb * (ctx // 16)].view(nb, ctx // 16).int()
    slot = (bt[:, -1].long() * 16 + 15)
    sl = torch.full((nb,), ctx, dtype=torch.int32, device=DEV)
    qsl = torch.arange(nb + 1, dtype=torch.int32, device=DEV)
    ids1 = torch.randint(0, QWEN3_8B["vocab_size"], (nb,), device=DEV)
    pos1 = torch.full((nb,), ctx - 1, device=DEV)
    kcont = [torch.randn(nb, ctx, hkv, d, device=DEV, dtype=torch.bfloat16) for _ in range(args.layers)]
    vcont = [torch.randn_like(x) for x in kcont]

    def strict_decode():
        def attend(layer, q, k, v):
            rk.write_kv_cache(k, v, kc[layer], vc[layer], slot)
            return rk.attention_paged(q, kc[layer], vc[layer], bt, sl, qsl, max_query_len=1, max_seq_len=ctx)
        with torch.no_grad():
            return model.logprobs(model.hidden_states(ids1, pos1, attend), ids1)

    def native_decode():
        def attend(layer, q, k, v):
            kcont[layer][:, -1] = k
            vcont[layer][:, -1] = v
            o = F.scaled_dot_product_attention(q[:, :, None], kcont[layer].transpose(1, 2), vcont[layer].transpose(1, 2),
                                               enable_gqa=True)
            return o[:, :, 0]
        with torch.no_grad(), rk.mode("native"):
            h = model.hidden_states(ids1, pos1, attend)
            return torch.log_softmax(F.linear(h, model.lm_head_weight).float(), -1).gather(1, ids1[:, None])[:, 0]

    out["profile_decode_step"] = top_kernels(strict_decode)
    t_s, t_n = bench(strict_decode, 200), bench(native_decode, 200)
    out["decode_step_b64_ctx2048"] = {"layers": args.layers, "strict_ms": round(t_s, 3), "native_ms": round(t_n, 3),
                                      "ratio_latency": round(t_s / t_n, 3),
                                      "note": "eager, no CUDA graphs on either side"}
    log("decode step:", out["decode_step_b64_ctx2048"])
    # the same step captured as a CUDA graph on both sides (what vLLM does in decode): the launch
    # and host costs leave; a host sync anywhere in the step would make the capture fail
    try:
        gs, gn = _graphed(strict_decode), _graphed(native_decode)
        t_s, t_n = bench(gs.replay, 200), bench(gn.replay, 200)
        out["decode_step_b64_ctx2048_cuda_graphs"] = {"layers": args.layers, "strict_ms": round(t_s, 3),
                                                      "native_ms": round(t_n, 3), "ratio_latency": round(t_s / t_n, 3)}
    except Exception as e:
        out["decode_step_b64_ctx2048_cuda_graphs"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    log("decode step, graphs:", out["decode_step_b64_ctx2048_cuda_graphs"])
    return out


def _graphed(fn):
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def train_timing(args, res, model):
    import torch
    import torch.nn.functional as F
    import rlkernel as rk
    B, L = 4, 2048
    ids = torch.randint(0, QWEN3_8B["vocab_size"], (B * L,), device=DEV)
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=DEV)
    pos = torch.arange(L, device=DEV).repeat(B)
    tg = torch.randint(0, QWEN3_8B["vocab_size"], (B * L,), device=DEV)
    model.requires_grad_(True)

    def strict_step():
        model.zero_grad(set_to_none=True)
        lp = model.logprobs(model.forward_packed(ids, cu), tg)
        lp.mean().backward()
        return lp

    def native_step():
        model.zero_grad(set_to_none=True)
        with rk.mode("native"):
            h = model.hidden_states(ids, pos, _sdpa_attend(B, L))
            lp = torch.log_softmax(F.linear(h, model.lm_head_weight).float(), -1).gather(1, tg[:, None])[:, 0]
        lp.mean().backward()
        return lp

    strict_step()
    res["profile_train_step"] = top_kernels(strict_step)
    g1 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "layers.0" in n}
    strict_step()
    rerun = all(torch.equal(g1[n], p.grad) for n, p in model.named_parameters() if n in g1)
    t_s, t_n = bench(strict_step, 300), bench(native_step, 300)
    model.zero_grad(set_to_none=True)
    model.requires_grad_(False)
    res["train"] = {"layers": args.layers, "tokens": B * L, "strict_ms": round(t_s, 2), "native_ms": round(t_n, 2),
                    "ratio_time": round(t_s / t_n, 3), "grads_rerun_equal": rerun}
    log("train:", res["train"])


def sweep(args, res):
    """Candidate tile configs (the data behind the choices in rlkernel/contracts/gpu.py): attention
    tiles timed on prefill and decode, each checked for prefill == decode bits; GEMM configs for
    the narrow class (qkv, o, down) at M = 16, 256, 4096."""
    import torch
    import torch.nn.functional as F
    from rlkernel.backends.triton import attention as A
    from rlkernel.backends.triton import gemm
    from rlkernel.contracts import gpu as G
    out = {"attention": {}, "gemm_narrow": {}}
    B, L = 8, 4096
    q = torch.randn(B * L, 32, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(B * L, 8, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=DEV)
    flops = 4 * B * 32 * L * L * 128 / 2
    pages = torch.randperm(B * L // 16, device=DEV).view(B, L // 16).int()
    kc = torch.empty(B * L // 16, 16, 8, 128, device=DEV, dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    for b in range(B):
        kc[pages[b].long()] = k[b * L:(b + 1) * L].view(L // 16, 16, 8, 128)
        vc[pages[b].long()] = v[b * L:(b + 1) * L].view(L // 16, 16, 8, 128)
    last = cu[1:].long() - 1
    sl = torch.full((B,), L, dtype=torch.int32, device=DEV)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    for bm, bn, w, st in ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 4, 3),
                          (256, 64, 8, 2), (128, 32, 4, 3)):
        cfg = G.AttentionTiles(block_m=bm, block_n=bn, seg_keys=G.ATTENTION_TILES.seg_keys, num_warps=w,
                                num_stages=st)
        key = f"m{bm}_n{bn}_w{w}_s{st}"
        try:
            full = A.attention_varlen(q, k, v, cu, max_seqlen=L, config=cfg)
            dec = A.attention_paged(q[last], kc, vc, pages, sl, qsl, max_query_len=1, max_seq_len=L, config=cfg)
            t_p = bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L, config=cfg))
            t_d = bench(lambda: A.attention_paged(q[last], kc, vc, pages, sl, qsl, max_query_len=1, max_seq_len=L,
                                                  config=cfg))
            t_pn = bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L, config=cfg, split=False, walk="nested"))
            nested = A.attention_varlen(q, k, v, cu, max_seqlen=L, config=cfg, split=False, walk="nested")
            out["attention"][key] = {"prefill_tflops": round(flops / t_p / 1e9, 1), "decode_b8_us": round(t_d * 1e3, 1),
                                     "prefill_nested_tflops": round(flops / t_pn / 1e9, 1),
                                     "decode_equals_prefill": bool(torch.equal(dec, full[last])),
                                     "nested_equals_flat": bool(torch.equal(nested, full))}
        except Exception as e:
            out["attention"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        log("sweep attn", key, out["attention"][key])
    del q, k, v, kc, vc
    cfgs = {"64x128x128_s4_w4": G.TileConfig(64, 128, 128, 4, 4), "128x128x64_s4_w8": G.TileConfig(128, 128, 64, 4, 8),
            "128x256x64_s3_w8": G.TileConfig(128, 256, 64, 3, 8), "64x256x64_s4_w4": G.TileConfig(64, 256, 64, 4, 4),
            "64x64x128_s4_w4": G.TileConfig(64, 64, 128, 4, 4), "128x128x128_s3_w8": G.TileConfig(128, 128, 128, 3, 8),
            "64x128x64_s5_w4": G.TileConfig(64, 128, 64, 5, 4)}
    for name in ("qkv", "o", "down"):
        kk, n = GEMMS[name]
        w_ = torch.randn(n, kk, device=DEV, dtype=torch.bfloat16) * 0.02
        for m in (16, 256, 4096):
            a = torch.randn(m, kk, device=DEV, dtype=torch.bfloat16)
            t_n = bench(lambda: F.linear(a, w_))
            row = {}
            for cname, c in cfgs.items():
                try:
                    row[cname] = round(t_n / bench(lambda: gemm.matmul(a, w_, config=c)), 3)
                except Exception as e:
                    row[cname] = f"{type(e).__name__}"
            out["gemm_narrow"][f"{name}_M{m}"] = row
            log("sweep gemm", name, m, row)
    res["sweep"] = out

#!/usr/bin/env python3
"""The strict update's launch savers on a GPU, bit for bit against their definitions, each timed against the old way:
`python3 scripts/gpu_strict_parity.py --only reduce` runs this (results under "reduce" in h200_strict_parity.json).

rlkernel.tree_sum's kernel against the torch composition; the vocab-parallel backward's chunked tiles (and the tile
fold kernel) against the per-tile loop; the row-parallel node and the one-rank column-parallel input gradient against
their per-segment partials and tree; SwiGLU's backward kernel (libdevice exp) against the composition (torch.exp);
the q/k norm in one call against one call per head segment; the RoPE kernel against the composition; the head norm +
RoPE launch against the two kernels; the engine layout's model (fused projections, residual adds in the
norms) against the plain one.
Split out of gpu_strict_parity.py (which keeps the parity harness, the kernels' timings and the sweeps).
"""
from __future__ import annotations


def run(res, dev, bench, log):
    import torch
    from rlkernel.backends.reference import primitives as P
    from rlkernel.backends.triton import reduce as R
    from rlkernel.backends.triton.ops import TRITON
    from rlkernel.contracts.logprob import VOCAB_TILE
    from rlkernel.parallel import vocab_parallel as vp
    out = {"tree_sum_equal": {}, "tree_sum_ms": {}}
    torch.manual_seed(0)
    for n, m in ((1, 5), (3, 1), (1000, 1), (4097, 3), (37, 4096), (1152, 1024), (9000, 130), (300_000, 1), (1 << 22, 1)):
        x = torch.randn(n, m, device=dev) * torch.exp(torch.randn(n, m, device=dev) * 8)
        x[torch.rand(n, m, device=dev) < 0.05] = -0.0
        got, want = R.tree_sum_rows(x), P.tree_sum_composition(x, dim=0)
        hook = P.tree_sum(x.t(), dim=-1)  # through the registered CUDA path (movedim + the kernel)
        out["tree_sum_equal"][f"{n}x{m}"] = bool(torch.equal(got.view(torch.int32), want.view(torch.int32))
                                                 and torch.equal(hook.view(torch.int32), want.view(torch.int32)))
        if (n, m) in ((1152, 1024), (1 << 22, 1), (37, 4096)):
            t_k, t_c = bench(lambda: R.tree_sum_rows(x)), bench(lambda: P.tree_sum_composition(x, dim=0))
            out["tree_sum_ms"][f"{n}x{m}"] = {"kernel": round(t_k, 4), "composition": round(t_c, 4),
                                              "speedup": round(t_c / t_k, 2)}
    log("tree_sum:", out)
    T, H, tiles = 1152, 1024, 32
    weight = (torch.randn(tiles * VOCAB_TILE, H, device=dev) * 0.02).bfloat16()
    h32 = torch.randn(T, H, device=dev)
    start = 3 * tiles * VOCAB_TILE
    targets = torch.randint(start - 1000, start + tiles * VOCAB_TILE + 1000, (T,), device=dev)
    lse = torch.randn(T, device=dev) + 9.0
    grad = torch.randn(T, device=dev)
    span = (start, start + tiles * VOCAB_TILE)
    segments = [(start + j * 8 * VOCAB_TILE, start + (j + 1) * 8 * VOCAB_TILE) for j in range(4)]
    args = (h32, weight, targets, lse, grad, start, span, segments, 1.0, TRITON)
    a, b = vp.local_backward(*args), vp.local_backward_per_tile(*args)
    out["vocab_backward_chunks_equal_tiles"] = bool(all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and torch.equal(a[1], b[1]))
    # the same shard split over two ranks (TP = 2 on one GPU: each half its own chunks and GEMM shapes): rank 0's
    # segment partials then rank 1's, and their dW rows, are the whole shard's bit for bit (the vocab-parallel
    # backward's TP invariance before the tree, under the bf16 operands of linear_logprob v3)
    half = tiles // 2 * VOCAB_TILE
    r0 = vp.local_backward(h32, weight[:half], targets, lse, grad, start, (start, start + half), segments[:2], 1.0, TRITON)
    r1 = vp.local_backward(h32, weight[half:], targets, lse, grad, start + half, (start + half, span[1]), segments[2:], 1.0,
                           TRITON)
    out["vocab_backward_tp2_equal_tp1"] = bool(all(torch.equal(x, y) for x, y in zip(r0[0] + r1[0], a[0]))
                                               and torch.equal(torch.cat([r0[1], r1[1]]), a[1]))
    t_c, t_t = bench(lambda: vp.local_backward(*args), 200), bench(lambda: vp.local_backward_per_tile(*args), 200)
    out["vocab_backward_ms"] = {"chunks": round(t_c, 3), "per_tile": round(t_t, 3), "speedup": round(t_t / t_c, 2),
                                "shape": [T, H, tiles * VOCAB_TILE]}
    log("vocab backward:", {k: out[k] for k in ("vocab_backward_chunks_equal_tiles", "vocab_backward_tp2_equal_tp1",
                                                "vocab_backward_ms")})
    from rlkernel.ops.linear import linear_segment_partials
    from rlkernel.parallel.collectives import tree_all_reduce
    from rlkernel.parallel.tp_backward import RowParallelLinearFn
    x = torch.randn(T, 3072, device=dev).bfloat16()
    w = (torch.randn(H, 3072, device=dev) * 0.02).bfloat16()
    gy = torch.randn(T, H, device=dev).bfloat16()
    xa, wa, xb, wb = (t.clone().requires_grad_() for t in (x, w, x, w))
    tree_all_reduce(linear_segment_partials(xa, wa, 4)).bfloat16().backward(gy)
    RowParallelLinearFn.apply(xb, wb, None, 4).bfloat16().backward(gy)
    out["row_parallel_two_gemm_backward_equal"] = bool(torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad))
    log("row-parallel backward:", out["row_parallel_two_gemm_backward_equal"])
    from rlkernel.backends.triton import gemm as G
    from rlkernel.parallel.tp_backward import ColumnParallelLinearFn, segment_rows
    col = {}
    for name, n_out, stride in (("qkv", 4096, 1), ("fc1", 6144, 2)):  # the loop's Qwen3-0.6B column linears, 4 segments
        x = torch.randn(T, H, device=dev).bfloat16().requires_grad_()
        w = (torch.randn(n_out, H, device=dev) * 0.02).bfloat16()
        gy = torch.randn(T, n_out, device=dev).bfloat16()
        ColumnParallelLinearFn.apply(x, w, None, None, 4, stride).backward(gy)
        perm = torch.cat(segment_rows(n_out, stride, 4)).to(dev)
        dy_s, w_s = gy[:, perm], w[perm]
        old = lambda: tree_all_reduce(linear_segment_partials(dy_s, w_s.t().contiguous(), 4)).bfloat16()  # noqa: E731
        want = old()
        sched = {s_: G.matmul(dy_s, w_s.t(), k_segments=4, schedule=s_) for s_ in ("launches", "registers", "split")}
        col[name] = {"equal": bool(torch.equal(x.grad, want)), "schedules_equal": {k: bool(torch.equal(v, want)) for k, v in sched.items()},
                     "ms": {"partials_and_tree": round(bench(old), 4),
                            **{k: round(bench(lambda s_=k: G.matmul(dy_s, w_s.t(), k_segments=4, schedule=s_)), 4) for k in sched}}}
    out["column_parallel_one_rank"] = col
    log("column-parallel dX at one rank:", col)
    from rlkernel.backends.reference import swiglu as ref_swiglu
    from rlkernel.backends.triton import swiglu_bwd
    sw = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # libdevice's exp against torch.exp, and the roundings
        inter = (torch.randn(T, 6144, device=dev) * 4).to(dtype)
        gate, up = inter.chunk(2, dim=-1)  # fc1's halves: strided rows
        dy = torch.randn(T, 3072, device=dev).to(dtype)
        got, want = swiglu_bwd.backward(gate, up, dy), ref_swiglu.backward(gate, up, dy, TRITON)
        sw[str(dtype)] = bool(all(torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                              b.view(torch.int16 if b.element_size() == 2 else torch.int32)) for a, b in zip(got, want)))
    out["swiglu_backward_equal"] = sw
    out["swiglu_backward_ms"] = {"kernel": round(bench(lambda: swiglu_bwd.backward(gate, up, dy)), 4),
                                 "composition": round(bench(lambda: ref_swiglu.backward(gate, up, dy, TRITON)), 4)}
    log("swiglu backward:", sw, out["swiglu_backward_ms"])
    import rlkernel as rk
    from rlkernel.backends.reference.norm import weight_grad_reducer
    from rlkernel.parallel.tp_backward import head_segment_weight_grad
    x = (torch.randn(T, 1, 16, 128, device=dev) * 3).bfloat16()  # a q norm of 16 heads in 4 canonical segments
    w = (1 + 0.1 * torch.randn(128, device=dev)).bfloat16()
    gy = torch.randn(T, 1, 16, 128, device=dev).bfloat16()
    xa, xb, wb = x.clone().requires_grad_(), x.clone().requires_grad_(), w.clone().requires_grad_()
    wa = [w.clone().requires_grad_() for _ in range(4)]
    torch.cat([rk.rms_norm(p, wj, 1e-6) for p, wj in zip(xa.chunk(4, dim=-2), wa)], dim=-2).backward(gy)
    with weight_grad_reducer(head_segment_weight_grad(16, 4, None, torch.bfloat16)):
        yb = rk.rms_norm(xb, wb, 1e-6)
    yb.backward(gy)
    out["head_norm_one_call_equal"] = bool(torch.equal(xa.grad, xb.grad) and torch.equal(wb.grad, tree_all_reduce([wj.grad for wj in wa])))
    log("head norm in one call:", out["head_norm_one_call_equal"])
    from rlkernel.backends.reference import rope as ref_rope
    from rlkernel.backends.triton import rope as tri_rope
    cos, sin = ref_rope.rope_table(128, 4096, 1e6, dev)
    pos = torch.randint(0, 4096, (T,), device=dev)
    rope_equal = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # bf16's rounding is checked here, not in the interpreter
        q = (torch.randn(T, 32, 128, device=dev) * 3).to(dtype)[:, ::2]  # 16 heads, a strided view
        rope_equal[str(dtype)] = bool(torch.equal(ref_rope.forward(q, pos, cos, sin), tri_rope.forward(q, pos, cos, sin))
                                      and torch.equal(ref_rope.forward(q, pos, cos, -sin), tri_rope.forward(q, pos, cos, -sin)))
    out["rope_kernel_equal"] = rope_equal
    q = torch.randn(T, 16, 128, device=dev).bfloat16()
    t_k, t_c = bench(lambda: tri_rope.forward(q, pos, cos, sin)), bench(lambda: ref_rope.forward(q, pos, cos, sin))
    out["rope_ms"] = {"kernel": round(t_k, 4), "composition": round(t_c, 4), "speedup": round(t_c / t_k, 2)}
    log("rope:", out["rope_kernel_equal"], out["rope_ms"])
    out["norm_rope"] = _norm_rope(dev, bench)
    log("head norm + rope in one launch:", out["norm_rope"])
    out["fused_projections"] = _fused_projections(dev, bench)
    log("fused projections:", out["fused_projections"])
    res["reduce"] = out


def _norm_rope(dev, bench):
    """Qwen3's head norm + RoPE as one launch (norm.norm_rope, reading the q/k view of a fused qkv output) against the
    norm kernel then the rope kernel (the copy of the strided view the norm makes included), bf16, at the 0.6B and 8B
    head counts: bits (torch.equal) and time."""
    import torch
    from rlkernel.backends.reference import rope as ref_rope
    from rlkernel.backends.triton import norm, rope

    cos, sin = ref_rope.rope_table(128, 8192, 1e6, dev)
    out = {}
    for name, (hq, hkv) in {"0.6b": (16, 8), "8b": (32, 8)}.items():
        w = (1.0 + 0.1 * torch.randn(128, device=dev)).bfloat16()
        for t in (1, 64, 256, 2048):
            qkv = (torch.randn(t, (hq + 2 * hkv) * 128, device=dev) * 3).bfloat16()
            q = qkv[:, :hq * 128].view(t, hq, 128)
            pos = torch.randint(0, 8192, (t,), device=dev)

            def two_ops():
                return rope.forward(norm.rms_norm(q, w, 1e-6), pos, cos, sin)

            def one_launch():
                return norm.norm_rope(q, w, 1e-6, pos, cos, sin)
            rec = {"equal": bool(torch.equal(one_launch(), two_ops())),
                   "two_ops_ms": round(bench(two_ops), 4), "one_launch_ms": round(bench(one_launch), 4)}
            out[f"{name}_q_T{t}"] = rec
    return out


def _fused_projections(dev, bench):
    """The rollout engine's layout (StrictDecoder.fuse_projections: q/k/v and gate/up one GEMM each, head norm + RoPE
    as one launch, the residual adds inside the norms; gate/up + SwiGLU as one launch where contracts.gpu.SWIGLU_EPILOGUE
    registers it) against the plain model, two layers at Qwen3-8B and 0.6B dimensions, bf16, under no_grad as an engine
    runs it: the final-normed hidden states bit for bit at decode and prefill row counts, the model's time both ways,
    and whether each registered fusion passed its first-use check."""
    import copy

    import torch
    from gpu_strict_parity import build_model
    from rlkernel.backends.triton import ops as O
    from rlkernel.ops.attention import attention_varlen

    shapes = {"8b": {}, "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8)}
    out = {}
    for name, dims in shapes.items():
        sep = build_model(2, device=dev, vocab_size=1024, **dims)  # a small vocabulary: the head is not compared
        fused = copy.deepcopy(sep)
        fused.fuse_projections()
        for t in (1, 64, 256, 2048):
            ids = torch.randint(0, 1024, (t,), device=dev)
            pos = torch.arange(t, device=dev)
            cu = torch.tensor([0, t], device=dev, dtype=torch.int32)

            def attend(_, q, k, v):
                return attention_varlen(q, k, v, cu)
            with torch.no_grad():
                a, b = sep.hidden_states(ids, pos, attend), fused.hidden_states(ids, pos, attend)
                rec = {"equal": bool(torch.equal(a, b))}
                rec["separate_ms"] = round(bench(lambda: sep.hidden_states(ids, pos, attend)), 4)
                rec["fused_ms"] = round(bench(lambda: fused.hidden_states(ids, pos, attend)), 4)
            out[f"{name}_T{t}"] = rec
    out["fusion_checks"] = {str(k): v for k, v in O.FUSION_CHECKS.items()}  # the first-use checks: True or why refused
    return out

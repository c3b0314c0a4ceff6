"""rlkernel's Triton backend on a CPU-only machine: it imports cleanly without touching triton,
it is registered as the strict implementation for CUDA under the GPU contracts (which are
data a CPU can diff), the GPU harness skips without CUDA, and (where triton is installed)
the kernels' index logic and the op wrappers' backwards run under TRITON_INTERPRET=1.

The interpreter is numpy: these prove walks, masks, the k-segment tree and the wrappers'
algebra against torch autograd, not the GPU's bits (scripts/gpu_strict_parity.py does that
on an H200).
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import interpreter_env, last_json

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_package_imports_without_touching_triton():
    code = ("import sys, rlkernel, rlkernel.backends.triton as t; "
            "print(any(m.split('.')[0] == 'triton' for m in sys.modules), t.available(), t.unavailable_reason())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported, available, reason = proc.stdout.split(" ", 2)
    assert imported == "False"  # kernels load lazily
    if available == "False":
        assert reason.strip() != "None"


def test_registered_for_cuda_under_gpu_contracts():
    import torch

    import rlkernel as rk
    from rlkernel import dispatch
    from rlkernel.contracts import gpu as G
    for op in ("linear", "rms_norm", "swiglu", "attention", "linear_logprob"):
        impl = dispatch._REGISTRY[(op, "triton")]
        assert impl.devices == ("cuda",) and impl.contract is G.BY_OP[op]
        assert impl.contract.backend == G.FAMILY and ("arch", G.ARCH) in impl.contract.partition
        assert rk.diff(impl.contract, rk.contract_for(op, "strict", "cpu"))  # another family: predicted to differ
    assert dispatch.resolve("linear", torch.device("cpu")).name in ("cpu", "reference")  # never chosen on the CPU
    with pytest.raises(rk.BackendUnavailable):
        with rk.mode(impl="triton"):
            rk.linear(torch.ones(1, 2), torch.ones(3, 2))


def test_tile_table_is_in_the_contract():
    """Every GEMM tile config is part of the contract's id, and every bf16 tile has block_m >= 64
    (Triton lowers those to wgmma, whose k16 chain the bits-vs-config proof covers)."""
    from rlkernel.contracts import gpu as G
    part = dict(G.LINEAR.partition)
    for name, cfg in G.BF16_GEMM.items():
        assert part[f"bf16_{name}"] == G._tiles(cfg) and cfg.block_m >= 64
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)):
        for m in (1, 64, 65, 256, 257, 1024, 1025, None):
            cfg = G.gemm_config("bfloat16", n, k, m)
            assert cfg in G.BF16_GEMM.values()
            # the one-launch K segments and the SwiGLU epilogue: the table's tile, columns halved until the live fp32
            # accumulators fit 128 registers a thread (block_m and block_k stay: still wgmma, still the same K walk)
            for live, fitted in [(2, G.swiglu_config("bfloat16", n, k, m))] + [
                    (G._LIVE_SEGMENT_ACCUMULATORS[s], G.segments_config("bfloat16", n, k, m, s)) for s in (2, 4, 8)]:
                assert (fitted.block_m, fitted.block_k, fitted.num_warps) == (cfg.block_m, cfg.block_k, cfg.num_warps)
                assert cfg.block_n % fitted.block_n == 0 and fitted.block_n >= 32
                assert live * fitted.block_m * fitted.block_n <= 128 * 32 * fitted.num_warps or fitted.block_n == 32
                assert fitted.block_n == cfg.block_n or live * fitted.block_m * fitted.block_n * 2 > 128 * 32 * fitted.num_warps
    assert G.segments_config("float32", 4096, 4096, 256, 4) == G.FP32_GEMM == G.swiglu_config("float32", 4096, 4096, 1)
    assert json.dumps(G.as_dict(G.LINEAR), default=str)


def test_segment_schedule_follows_the_measured_rule():
    """The row-parallel layers' k-segment schedule (ops.segment_schedule, session 20's H200 sweep): fixup at decode
    sizes, registers to 128 rows, scratch (since session 28 "warpspec", scratch where no Gluon tile serves) from 256 rows at the 8B widths and above REGISTERS_MAX_M at the 0.6B's, at
    every M above (no plain GEMM per segment); scratch's tile is the table's capped at 128 x 128, fixup's tiles are table
    tiles (or the 128 x 256 one with pointer loads) with block_m >= 64."""
    from dataclasses import replace
    from rlkernel.backends.triton import gemm, ops as O
    from rlkernel.contracts import gpu as G
    big = replace(G.BF16_GEMM["t128x256"], tma=False)
    ws = "warpspec"  # session 28: the Gluon consumer where scratch ran; gemm.matmul runs scratch where it cannot serve
    want = {(4096, 4096): {1: "fixup", 64: "fixup", 65: "registers", 128: "registers", 129: ws, 256: ws,
                           1024: ws, 4096: ws, 65536: ws},
            (4096, 12288): {64: "fixup", 128: "registers", 256: ws},
            (1024, 3072): {1: "fixup", 64: "fixup", 128: "registers", 256: "registers", 512: "registers",
                           513: ws, 1024: ws, 8192: ws}}
    for (n, k), by_m in want.items():
        for m, sched in by_m.items():
            assert O.segment_schedule(m, n, k, 4) == sched, (n, k, m)
            cfg = G.fixup_config("bfloat16", n, k, m, 4)
            assert cfg.block_m >= 64 and (cfg in G.BF16_GEMM.values() or cfg == big)
            table = G.gemm_config("bfloat16", n, k, m)
            tile = gemm.schedule_config("bfloat16", n, k, m, 4, "scratch")
            assert tile == (table if table.block_m * table.block_n <= 128 * 128 else G.BF16_GEMM["t128x128"]), (n, k, m)
            assert tile.block_m * tile.block_n <= gemm.SCRATCH_SLICED_ABOVE  # the table's scratch runs unsliced
    assert gemm.schedule_config("float32", 4096, 4096, 4096, 4, "scratch") == G.gemm_config("float32", 4096, 4096, 4096)
    assert O.segment_schedule(1, 4096, 4096, 1) is None  # no segments: the plain GEMM
    assert G.fixup_config("float32", 4096, 4096, 256, 4) == G.FP32_GEMM


def test_stage_fit_counts_the_unshared_segment_loops():
    """The GEMM's pipeline depth fits shared memory with the "registers" schedule's segment loops counted when they run
    on pointer loads (each loop its own buffers under Triton 3.6): the model reproduces what the H200 refused (a 2-layer
    toy Qwen3, hidden 64, its row-parallel GEMM at M = 1,152: 128 x 64 x 64, 3 stages, 4 segments, bf16, "Required:
    311296"), the depth chosen for it fits, and one loop (TMA, or no segments) keeps the depths the H200 ran."""
    from dataclasses import replace
    from rlkernel.backends.triton import gemm as K
    from rlkernel.contracts import gpu as G
    toy = G.segments_config("bfloat16", 64, 64, 1152, 4)
    assert (toy.block_m, toy.block_n, toy.block_k, toy.num_stages) == (128, 64, 64, 3)
    assert K._smem_bytes(toy, 3, 2, 2, loops=4) - 1024 == 311296 > K._SMEM_LIMIT  # the H200's figure, refused
    assert K._smem_bytes(toy, K._stages(toy, 2, 2), 2, 2, loops=4) > K._SMEM_LIMIT  # one loop counted: what crashed
    st = K._stages(toy, 2, 2, loops=4)
    assert st == 2 and K._smem_bytes(toy, st, 2, 2, loops=4) <= K._SMEM_LIMIT
    assert K._stages(replace(toy, num_stages=1), 2, 2, loops=8) == 1  # never below one stage
    for cfg in G.BF16_GEMM.values():  # one loop: what every table tile ran with on the H200
        assert K._stages(cfg, 2, 2) == K._stages(cfg, 2, 2, loops=1) and K._smem_bytes(cfg, K._stages(cfg, 2, 2), 2, 2) <= K._SMEM_LIMIT


def test_gpu_harness_skips_without_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the harness would run, not skip")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_strict_parity.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "gpu_strict_parity.json").read_text()) == {"skipped": "no CUDA device"}
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_strict_parity import card_name
    finally:
        sys.path.pop(0)
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", "AMD Instinct MI300X",
             "Tesla"]
    assert [card_name(n) for n in names] == ["h100", "h200", "gh200", "a100", "mi300", "gpu"]  # the result's prefix
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_loop.py"), "--out", str(tmp_path / "loop")],
                          capture_output=True, text=True, timeout=300)  # the loop harness: skips, writes nothing
    assert proc.returncode == 0 and last_json(proc.stdout)["skipped"].startswith("no CUDA device")
    assert not (tmp_path / "loop").exists() or not any((tmp_path / "loop").iterdir())
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_fa3_compare.py"), "--out", str(tmp_path / "fa3")],
                          capture_output=True, text=True, timeout=300)  # the FA3 comparison: skips, writes nothing
    assert proc.returncode == 0 and last_json(proc.stdout) == {"skipped": "no CUDA device"}
    assert not (tmp_path / "fa3").exists()
    smoke = ROOT / "scripts" / "gpu_shape_smoke.py"  # other model shapes: skips without CUDA; its update check on the CPU
    proc = subprocess.run([sys.executable, str(smoke), "--out", str(tmp_path / "smoke")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and last_json(proc.stdout)["skipped"].startswith("no CUDA device")
    proc = subprocess.run([sys.executable, str(smoke), "--device", "cpu", "--shapes", "toy", "--checks", "updates", "--out",
                           str(tmp_path / "smoke")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    toy = json.loads((tmp_path / "smoke" / "shape_smoke.json").read_text())["shapes"]["toy"]["updates"]
    assert toy["ok"] and toy["rescore_equal"] and toy["weights_moved"] and len(toy["losses"]) == 2, toy
    prof = ROOT / "scripts" / "gpu_update_profile.py"  # the update profiler: skips without CUDA, runs on the CPU if asked
    proc = subprocess.run([sys.executable, str(prof), "--out", str(tmp_path / "prof")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and last_json(proc.stdout)["skipped"].startswith("no CUDA device")
    proc = subprocess.run([sys.executable, str(prof), "--device", "cpu", "--tiny", "--dtype", "float32", "--warmup", "1", "--repeat", "1",
                           "--out", str(tmp_path / "prof")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads((tmp_path / "prof" / "cpu_update_profile.json").read_text())
    for mode in ("strict", "native"):
        m = rep["modes"][mode]
        assert m["median_seconds"] > 0 and m["profile"]["wall_seconds"] > 0 and m["profile"]["top_by_host"], (mode, m)
        assert [w["time_compile"] for w in m["warmup"]] == [None] and m["warmup"][0]["seconds"] > 0  # no Triton off CUDA
        sites = m["profile"]["op_sites"]
        assert sites["ops"] >= sum(x["ops"] for x in sites["top"]) > 0 and all(":" in x["site"] for x in sites["top"][:3])
        reads = m["profile"]["readbacks"]  # every update reads at least its loss and grad norm back to the host
        assert reads["readbacks"] >= sum(x["count"] for x in reads["top"]) >= 2 and all(" @ " in x["site"] for x in reads["top"])
        assert any("vime/trainer.py" in x["site"] for x in reads["top"]), reads
        host = m["profile"]["host_functions"]  # cProfile of one update: this repository's Python is on the list
        areas = host["own_ms_by_area"]  # each rounded to 0.001 ms: their sum is the total within the rounding
        assert abs(host["total_own_ms"] - sum(areas.values())) <= 1e-3 * (len(areas) + 1) and areas["rlkernel"] > 0
        assert any(x["function"].startswith("rlkernel/") for x in host["top_by_cumulative"]), host
    assert rep["ratio_strict_over_native"] > 0 and rep["code"]["source_sha256"]
    poison = rep["poisoned_equal"]  # a strict update with torch's NaN fill on equals the default (fill off)
    assert poison["tensors"] > 0 and poison["tensors_differ"] == 0 and poison["loss_equal"] and poison["grad_norm_equal"], poison


_INTERPRET = textwrap.dedent('''
    import math, sys, torch
    import rlkernel.backends.triton as rk
    C = rk.contracts
    from rlkernel.backends.triton import gemm
    gemm._num_sms = lambda d: 3
    torch.manual_seed(0)
    cfg = C.TileConfig(16, 16, 16, 2, 4, tma=False)
    a, w = torch.randn(21, 40), torch.randn(37, 40)
    assert (rk.matmul(a, w, config=cfg) - a @ w.T).abs().max() < 1e-4
    assert torch.equal(rk.matmul(a[5:6], w, config=cfg)[0], rk.matmul(a, w, config=cfg)[5])
    x, nw = torch.randn(4, 48), torch.rand(48) + 0.5
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    assert (rk.rms_norm(x, nw) - ref).abs().max() < 1e-5
    hid, W, t = torch.randn(5, 16), torch.randn(70, 16), torch.randint(0, 66, (5,))
    lp = rk.linear_logprob(hid, W, t, 0.7, vocab_size=66, config=cfg)
    ref = torch.log_softmax(hid @ W[:66].T / 0.7, -1).gather(1, t[:, None])[:, 0]
    assert (lp - ref).abs().max() < 1e-4
    acfg = C.AttentionContract(block_m=8, block_n=8, seg_keys=16, page_size=4)
    hq, hkv, d, lens = 4, 2, 16, [29, 3]
    cu = torch.tensor([0, 29, 32])
    q, k, v = torch.randn(32, hq, d), torch.randn(32, hkv, d), torch.randn(32, hkv, d)
    full = rk.attention_varlen(q, k, v, cu, config=acfg)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:29].transpose(0, 1), k[:29].transpose(0, 1).repeat_interleave(2, 0),
                                                           v[:29].transpose(0, 1).repeat_interleave(2, 0), is_causal=True).transpose(0, 1)
    assert (full[:29] - ref).abs().max() < 1e-4
    assert torch.equal(full, rk.attention_varlen(q, k, v, cu, config=acfg, split=True))
    assert torch.equal(full, rk.attention_varlen(q, k, v, cu, config=acfg, split=False, walk="nested"))
    # packed K / V load through tensor descriptors (TMA on the GPU; the interpreter runs them too): the same bits as the
    # pointer loads, also for K / V as views of a fused qkv projection (rows strided past the heads)
    from rlkernel.backends.triton import attention as A_
    assert A_._tma_ok(k, v, d, d)
    with A_.tma_off():
        assert torch.equal(full, rk.attention_varlen(q, k, v, cu, config=acfg))
        assert torch.equal(full, rk.attention_varlen(q, k, v, cu, config=acfg, split=True))
    # the kernels they name for `vime diagnose` (rlkernel.dispatch.note_kernel; built only while observed)
    from rlkernel import dispatch
    token = dispatch._NOTES.set([])
    rk.matmul(a, w, config=cfg); rk.matmul(torch.randn(9, 256), torch.randn(40, 256), k_segments=4, schedule="scratch")
    rk.attention_varlen(q, k, v, cu, config=acfg, split=True)
    notes = dispatch._NOTES.get(); dispatch._NOTES.reset(token)
    assert notes[0] == "gemm triton 16x16x16 w4" and notes[1].startswith("gemm triton") and notes[1].endswith(
        ", 4 K segments scratch") and notes[2].startswith("attention triton packed tma, split in "), notes
    qkv = torch.cat([q, k, v], 1)
    qv, kv_, vv_ = qkv.split([hq, hkv, hkv], 1)
    assert A_._tma_ok(kv_, vv_, d, d) and kv_.stride(0) == (hq + 2 * hkv) * d
    assert torch.equal(full, rk.attention_varlen(qv, kv_, vv_, cu, config=acfg))
    kc = torch.full((12, 4, hkv, d), float("nan")); vc = kc.clone()
    bt = torch.tensor([[7, 2, 9, 0, 11, 4, 1, 8], [3, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    for i, L in enumerate(lens):
        pos = torch.arange(L)
        rk.write_kv_cache(k[int(cu[i]):int(cu[i]) + L], v[int(cu[i]):int(cu[i]) + L], kc, vc, bt[i, pos // 4].long() * 4 + pos % 4)
    for t in (0, 2, 7, 8, 15, 16, 28):
        rows = [t] + ([29 + t] if t < 3 else [])
        sl = torch.tensor([t + 1] * len(rows), dtype=torch.int32)
        for split in (None, True, False):
            od = rk.attention_paged(q[rows], kc, vc, bt[:len(rows)], sl, torch.arange(len(rows) + 1), config=acfg, split=split)
            assert torch.equal(od, full[rows]), (t, split)
            od = rk.attention_paged(q[rows], kc, vc, bt[:len(rows)], sl, torch.arange(len(rows) + 1), config=acfg,
                                    split=False, walk="nested")
            assert torch.equal(od, full[rows]), (t, "nested")
    # a decode step as vLLM captures it in a CUDA graph (vime's strict decode graphs): the grid sized from the engine's
    # max_model_len, padded requests (query length 0, seq_len 0) and padded query rows; the real rows keep their bits
    rows = [28, 29 + 2]
    qp = torch.cat([q[rows], torch.randn(3, hq, d)])
    btp = torch.cat([bt, torch.zeros(2, 8, dtype=torch.int32)])
    sl, qsl = torch.tensor([29, 3, 0, 0], dtype=torch.int32), torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)
    for split in (None, True, False):
        od = rk.attention_paged(qp, kc, vc, btp, sl, qsl, config=acfg, split=split, max_query_len=1, max_seq_len=64)
        assert torch.equal(od[:2], full[rows]), ("graph-shaped decode", split)
    kk, vv = torch.randn(7, 2, 16), torch.randn(7, 2, 16)  # the KV write: negative slots skipped, any cache strides
    for layout in ("plain", "vllm"):
        if layout == "plain":
            kc2 = torch.full((5, 4, 2, 16), float("nan")); vc2 = kc2.clone()
        else:  # vLLM's CPU cache: [nb, Hkv, 2*bs, D], k and v as chunked, transposed views
            kc2, vc2 = torch.full((5, 2, 8, 16), float("nan")).chunk(2, dim=2)
            kc2, vc2 = kc2.transpose(1, 2), vc2.transpose(1, 2)
        slots = torch.tensor([3, -1, 17, 0, 9, -1, 19])
        rk.write_kv_cache(kk, vv, kc2, vc2, slots)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                assert torch.equal(kc2[s // 4, s % 4], kk[t]) and torch.equal(vc2[s // 4, s % 4], vv[t])
        assert int((~torch.isnan(kc2[..., 0, 0])).sum()) == 5
    # Hkv and D not powers of two (SmolLM2's 3 KV heads; the kernel pads to 4 and 32 and masks): the kernel writes
    # them itself (the indexed copy's host sync breaks a CUDA graph capture), nothing past the real heads or dims
    kk, vv = torch.randn(4, 3, 24), torch.randn(4, 3, 24)
    big_k, big_v = torch.full((3, 4, 4, 32), float("nan")), torch.full((3, 4, 4, 32), float("nan"))
    kc3, vc3 = big_k[:, :, :3, :24], big_v[:, :, :3, :24]  # a view: padding beyond it must stay untouched
    assert rk.write_kv_supported(kk, vv, kc3, vc3)
    slots = torch.tensor([5, -1, 0, 11])
    rk.write_kv_cache(kk, vv, kc3, vc3, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc3[s // 4, s % 4], kk[t]) and torch.equal(vc3[s // 4, s % 4], vv[t])
    assert int((~torch.isnan(big_k)).sum()) == 3 * 3 * 24 and torch.isnan(big_k[..., 3, :]).all() and torch.isnan(big_v[..., 24:]).all()
    out = torch.cat([rk.attention_paged(q[lo:hi], kc, vc, bt[:1], torch.tensor([hi]), torch.tensor([0, hi - lo]), config=acfg)
                     for lo, hi in ((0, 5), (5, 17), (17, 29))])
    assert torch.equal(out, full[:29])
    # context parallelism's pieces (rlkernel.parallel.context_parallel): the gathered stream as a cache of block size 1,
    # local queries = the last rows of sequence 0 and all of sequence 1
    kc1, vc1 = k.reshape(32, 1, hkv, d), v.reshape(32, 1, hkv, d)
    tab = torch.stack([torch.arange(29), (29 + torch.arange(29)).clamp(max=31)]).to(torch.int32)
    od = rk.attention_paged(q[10:32], kc1, vc1, tab, torch.tensor([29, 3], dtype=torch.int32), torch.tensor([0, 19, 22], dtype=torch.int32),
                            config=acfg)
    assert torch.equal(od, full[10:32])
    # a GQA group that does not divide the tile (G = 3 in an 8-row tile: 2 tokens x 3 heads + 2 padding rows; SmolLM2's
    # 9/3 heads, Qwen2.5's 7): every row against torch, split == unsplit, decode rows == prefill rows, chunked prefill
    hq3 = 6
    q3 = torch.randn(32, hq3, d)
    full3 = rk.attention_varlen(q3, k, v, cu, config=acfg)
    for lo, hi in ((0, 29), (29, 32)):
        ref3 = torch.nn.functional.scaled_dot_product_attention(
            q3[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1).repeat_interleave(3, 0),
            v[lo:hi].transpose(0, 1).repeat_interleave(3, 0), is_causal=True).transpose(0, 1)
        assert (full3[lo:hi] - ref3).abs().max() < 1e-4, (lo, hi)
    assert torch.equal(full3, rk.attention_varlen(q3, k, v, cu, config=acfg, split=True))
    for t in (0, 1, 2, 7, 8, 15, 28):
        od = rk.attention_paged(q3[[t]], kc, vc, bt[:1], torch.tensor([t + 1], dtype=torch.int32), torch.arange(2), config=acfg)
        assert torch.equal(od, full3[[t]]), ("G=3 decode", t)
    out3 = torch.cat([rk.attention_paged(q3[lo:hi], kc, vc, bt[:1], torch.tensor([hi]), torch.tensor([0, hi - lo]), config=acfg)
                      for lo, hi in ((0, 5), (5, 17), (17, 29))])
    assert torch.equal(out3, full3[:29])
    try:  # a head dim the kernels cannot tile (not a power of two) is refused with the reason, not a compile error
        rk.attention_varlen(torch.randn(5, 4, 12), torch.randn(5, 2, 12), torch.randn(5, 2, 12), torch.tensor([0, 5]))
        raise SystemExit("head_dim 12 was not refused")
    except ValueError as e:
        assert "power of two" in str(e) and "got 12" in str(e), e
    print("ok")
''')


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_under_triton_interpreter():
    """Index logic, masking and the prefill == decode == chunked-prefill == split property at tiny
    sizes on the CPU (the interpreter is numpy, so this proves the walk, not the GPU's bits)."""
    pytest.importorskip("torch")
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", _INTERPRET], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


_WRAPPERS = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    import rlkernel as rk
    from rlkernel.backends.triton import gemm, ops as O
    from rlkernel.contracts import gpu as G
    gemm._num_sms = lambda d: 3
    torch.manual_seed(0)
    def close(a, b, tol):
        assert (a - b).abs().max().item() < tol, (a - b).abs().max().item()
    # linear: forward, k-segment tree, backward vs torch autograd; a row alone == inside the batch
    x = torch.randn(10, 64, requires_grad=True); w = torch.randn(48, 64, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    y, yr = O.linear(x, w, b, 2), F.linear(x, w, b)
    close(y, yr, 1e-4)
    g = torch.randn_like(y)
    for a, r in zip(torch.autograd.grad(y, (x, w, b), g), torch.autograd.grad(yr, (x, w, b), g)):
        close(a, r, 1e-4)
    xd, wd = x.detach(), w.detach()
    assert torch.equal(O.linear(xd[3:4], wd), O.linear(xd, wd)[3:4])
    # in-kernel canonical segments == per-segment GEMMs merged by rk.tree_sum (TMA and pointer paths)
    xs, ws = torch.randn(9, 256), torch.randn(40, 256)
    for S in (2, 4, 8):
        for tma in (False, True):
            cfg = G.TileConfig(16, 16, 16, 2, 4, tma=tma)
            one = gemm.matmul(xs, ws, k_segments=S, config=cfg, out_dtype=torch.float32, schedule="registers")
            seg = 256 // S
            parts = [gemm.matmul(xs[:, i * seg:(i + 1) * seg].contiguous(), ws[:, i * seg:(i + 1) * seg].contiguous(),
                                 config=cfg, out_dtype=torch.float32) for i in range(S)]
            assert torch.equal(one, rk.tree_sum(torch.stack(parts, -1), -1)), (S, tma)
            if S >= 4:  # control: the left fold of the same partials differs: the equalities below see the tree's order
                fold = parts[0]
                for p_ in parts[1:]:
                    fold = fold + p_
                assert not torch.equal(fold, one), (S, tma)
            for sched in ("launches", "split", "registers", "fixup", "scratch") + (("stream",) if S < 8 else ()):  # same bits
                got = gemm.matmul(xs, ws, k_segments=S, config=cfg, out_dtype=torch.float32, schedule=sched)
                assert torch.equal(got, one), (S, tma, sched)
                got = gemm.matmul(xs, b=ws.t().contiguous(), k_segments=S, config=cfg, out_dtype=torch.float32,
                                  schedule=sched)
                assert torch.equal(got, one), (S, tma, sched, "b")
            # scratch's sliced merges (tiles above SCRATCH_SLICED_ABOVE, 128 x 256 on the GPU; here every tile): 64-row
            # tiles merged in two 32-row slices from memory, the last merge storing the tile; rows beyond M masked
            cfg64 = G.TileConfig(64, 16, 16, 2, 4, tma=tma)
            above, gemm.SCRATCH_SLICED_ABOVE = gemm.SCRATCH_SLICED_ABOVE, 0
            try:
                for xm in (xs, torch.randn(70, 256)):
                    ref64 = gemm.matmul(xm, ws, k_segments=S, config=cfg64, out_dtype=torch.float32, schedule="launches")
                    got = gemm.matmul(xm, ws, k_segments=S, config=cfg64, out_dtype=torch.float32, schedule="scratch")
                    assert torch.equal(got, ref64), (S, tma, "sliced", xm.shape[0])
            finally:
                gemm.SCRATCH_SLICED_ABOVE = above
    # two-accumulator tiles (block_n2: 96- or 192-column tiles on the GPU): each output column in the right accumulator
    # and place, column tails in either accumulator, TMA and pointer loads, both B layouts. Integer-valued inputs, so
    # every sum is exact whatever the interpreter's order: this checks the walk (the GPU's bits: gpu_gemm_sweep)
    xi, wi = torch.randint(-3, 4, (37, 80)).float(), torch.randint(-3, 4, (70, 80)).float()
    exact = xi @ wi.T
    for tma in (False, True):
        for n1, n2 in ((32, 16), (16, 32), (16, 16)):
            cfg2 = G.TileConfig(16, n1, 16, 2, 4, tma=tma, block_n2=n2)
            assert torch.equal(gemm.matmul(xi, wi, config=cfg2), exact), (tma, n1, n2)
            assert torch.equal(gemm.matmul(xi, b=wi.t().contiguous(), config=cfg2), exact), (tma, n1, n2, "b")
    try:
        gemm.matmul(xi, wi, config=G.TileConfig(16, 16, 16, 2, 4, block_n2=16), k_segments=2)
        raise AssertionError("a two-accumulator tile with k segments was accepted")
    except ValueError as e:
        assert "two-accumulator" in str(e)
    for bad in (48, 8):
        try:
            G.TileConfig(16, 16, 16, 2, 4, block_n2=bad)
            raise AssertionError(f"block_n2={bad} was accepted")
        except ValueError as e:
            assert "power of two" in str(e)
    # fixup's per-tile counters: zero again after every launch, so back-to-back calls agree; a launch with more tiles
    # grows the cached buffer (the interpreter runs programs one after another, so the last arrival varies by tile)
    cfg, counters = G.TileConfig(16, 16, 16, 2, 4, tma=False), gemm._FIXUP_COUNTERS
    gemm._FIXUP_MIN_COUNTERS = 1  # so these small launches grow the buffer (default: 4096 counters from the start)
    counters.clear()
    xl = torch.randn(40, 256)  # 3 x 3 tiles of 16 x 16 where xs has 1 x 3
    tall = G.TileConfig(64, 16, 16, 2, 4)  # a 64-row tile: the merge's two 32-row slices
    for xx in (xs, xl):
        assert torch.equal(gemm.matmul(xx, ws, k_segments=4, config=tall, schedule="fixup"),
                           gemm.matmul(xx, ws, k_segments=4, config=tall, schedule="registers"))
    sizes = []
    for S in (2, 4):
        for xx in (xs, xl, xs):
            want = gemm.matmul(xx, ws, k_segments=S, config=cfg, schedule="registers")
            first = gemm.matmul(xx, ws, k_segments=S, config=cfg, schedule="fixup")
            (buf,) = counters.values()  # this process's one (device, stream)
            sizes.append(buf.numel())
            assert sizes[-1] >= -(-xx.shape[0] // 16) * 3 and not buf.any(), (S, buf)
            again = gemm.matmul(xx, ws, k_segments=S, config=cfg, schedule="fixup")
            assert torch.equal(first, want) and torch.equal(again, want), (S, xx.shape)
    assert sizes[0] == 3 and sizes[1] >= 9 and sizes == sorted(sizes), sizes  # grown for xl, never shrunk
    # the buffer it replaced is kept alive (a CUDA graph captured with it holds its address), all zero
    assert [r.numel() for r in gemm._FIXUP_RETIRED][-1:] == [3] and not any(r.any() for r in gemm._FIXUP_RETIRED)
    buf[1] = 1  # control: a counter left at 1 makes the first arrival merge, and the tile ends at 1, not 0
    gemm.matmul(xs, ws, k_segments=2, config=cfg, schedule="fixup")
    assert buf.tolist().count(1) == 1 and buf.sum() == 1, buf
    buf.zero_()
    try:
        gemm.matmul(xs, ws, k_segments=4, schedule="fixup", num_ctas=2)
        raise AssertionError("fixup with num_ctas=2 was accepted")
    except ValueError as e:
        assert "num_ctas must be 1" in str(e)
    try:
        gemm.matmul(xs, ws, k_segments=8, config=G.TileConfig(16, 16, 16, 2, 4), schedule="stream")
        raise AssertionError("stream with 8 segments was accepted")
    except ValueError as e:
        assert "'stream' needs 2 or 4 segments" in str(e)
    try:
        gemm.matmul(xs, ws, num_ctas=3)
        raise AssertionError("num_ctas=3 was accepted")
    except ValueError as e:
        assert "num_ctas must be 1, 2 or 4" in str(e)
    # linear-logprob: targets, backward, the full table equals the targets kernel bit for bit, entropy
    O.VOCAB_CHUNK = 256
    h = torch.randn(6, 32, requires_grad=True); W = torch.randn(700, 32, requires_grad=True)
    tg = torch.randint(0, 650, (6,))
    lp = O.linear_logprob("targets", h, W, tg, 0.7, 650)
    lpr = torch.log_softmax(h @ W[:650].T / 0.7, -1).gather(1, tg[:, None])[:, 0]
    close(lp, lpr, 1e-4)
    gg = torch.randn(6)
    for a, r in zip(torch.autograd.grad(lp, (h, W), gg), torch.autograd.grad(lpr, (h, W), gg)):
        close(a, r, 1e-4)
    full = O.linear_logprob("full", h.detach(), W.detach(), None, 0.7, 650)
    assert torch.equal(full.gather(1, tg[:, None])[:, 0], lp.detach())
    ref = torch.log_softmax(h @ W[:650].T / 0.7, -1)
    ent, entr = O.linear_logprob("entropy", h, W, None, 0.7, 650), -(ref.exp() * ref).sum(-1)
    close(ent, entr, 1e-3)
    for a, r in zip(torch.autograd.grad(ent.sum(), (h, W)), torch.autograd.grad(entr.sum(), (h, W))):
        close(a, r, 1e-3)
    # the vocab split over ranks (rk.vocab_parallel_logprob / _entropy on the GPU): each shard's first-stage tiles,
    # gathered (here in another order than the vocab's), merged by the kernel's tree == the one-call kernel, bitwise
    from rlkernel.backends.triton import logprob as TL
    from rlkernel.parallel import collectives as PC
    V2, hd, Wd = 1250, h.detach(), torch.randn(1300, 32)
    tg2 = torch.randint(0, V2, (6,))
    meta = [[1024, 1250, 6, V2], [0, 512, 6, V2], [512, 1024, 6, V2]]  # rank r's true-vocab [lo, hi), T, V
    counts = PC._triton_tiles(torch.float32, meta)
    assert sum(counts) == -(-V2 // TL.tile_rows(torch.float32)), counts
    width = max(counts)
    stages = torch.stack([PC._triton_stage(hd, Wd[lo:lo + 512], tg2 - lo, 0.7, hi - lo, width) for lo, hi, *_ in meta])
    lp2, lse2 = PC._triton_merge(stages, meta, counts, width)
    want_lp, want_lse = TL.linear_logprob(hd, Wd, tg2, 0.7, vocab_size=V2, return_lse=True)
    assert torch.equal(lp2, want_lp) and torch.equal(lse2, want_lse)
    parts = torch.cat([O.entropy_tile_sums(hd, Wd[lo:lo + 512], want_lse, 0.7, 0, hi - lo) for lo, hi in ((0, 512), (512, 1024), (1024, 1250))], 1)
    assert torch.equal(parts, O.entropy_tile_sums(hd, Wd, want_lse, 0.7, 0, V2))
    assert torch.equal(want_lse - rk.tree_sum(parts, -1), O.linear_logprob("entropy", hd, Wd, None, 0.7, V2))
    # rms_norm and swiglu through the shared explicit backwards
    xn = torch.randn(5, 64, requires_grad=True); wn = torch.rand(64, requires_grad=True)
    yn, ynr = O.rms_norm(xn, wn, 1e-6), F.rms_norm(xn, (64,), wn, 1e-6)
    close(yn, ynr, 1e-5)
    for a, r in zip(torch.autograd.grad(yn.sum(), (xn, wn)), torch.autograd.grad(ynr.sum(), (xn, wn))):
        close(a, r, 1e-4)
    res, c = torch.randn(5, 64, requires_grad=True), torch.randn(5, 64)  # the residual form: (y, x + residual)
    yr2, hr2 = O.rms_norm(xn, wn, 1e-6, residual=res)
    hh = xn + res
    loss_a = yr2.sum() + (hr2 * c).sum()
    loss_r = F.rms_norm(hh, (64,), wn, 1e-6).sum() + (hh * c).sum()
    for a, r in zip(torch.autograd.grad(loss_a, (xn, wn, res)), torch.autograd.grad(loss_r, (xn, wn, res))):
        close(a, r, 1e-4)
    gt, up = torch.randn(4, 40, requires_grad=True), torch.randn(4, 40, requires_grad=True)
    s, sr = O.swiglu(gt, up), F.silu(gt) * up
    close(s, sr, 1e-5)
    for a, r in zip(torch.autograd.grad(s.sum(), (gt, up)), torch.autograd.grad(sr.sum(), (gt, up))):
        close(a, r, 1e-5)
    print("ok")
''')


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_op_wrappers_under_triton_interpreter():
    """The registered wrappers (k-segment tree, bias, backwards, full/entropy logprob) against
    torch autograd; the in-kernel segment merge against rk.tree_sum of per-segment GEMMs."""
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", _WRAPPERS], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]

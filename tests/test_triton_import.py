"""rlkernel's Triton backend on a CPU-only machine: it imports cleanly, its contracts are
data whose tile choice never sees the row count, the GPU harness skips without CUDA, and
(where triton is installed) the kernels' index logic runs under TRITON_INTERPRET=1.

The backend folder is loaded as a standalone package so these tests do not depend on the
rest of rlkernel's import graph.
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

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "rlkernel" / "backends" / "triton"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _load(name="rk_triton_under_test"):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PKG / "__init__.py", submodule_search_locations=[str(PKG)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_package_imports_without_touching_triton():
    before = set(sys.modules)
    rk = _load()
    assert rk.contracts.ATTENTION.seg_keys % rk.contracts.ATTENTION.block_n == 0
    assert not any(m.split(".")[0] == "triton" for m in set(sys.modules) - before)  # kernels load lazily
    assert isinstance(rk.available(), bool)
    if rk.available() is False:
        assert rk.unavailable_reason()


def test_tile_config_never_sees_the_row_count():
    C = _load().contracts
    assert list(inspect.signature(C.gemm_config).parameters) == ["dtype_name", "n", "k"]
    assert list(inspect.signature(C.logprob_contract).parameters) == ["dtype_name", "v", "h"]
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)):
        cfg = C.gemm_config("bfloat16", n, k)
        assert cfg in C.BF16_GEMM.values()
        assert json.dumps(C.as_dict(C.gemm_contract("bfloat16", n, k)), default=str)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_modules_import_on_cpu():
    rk = _load()
    for name in ("matmul", "matmul_swiglu", "swiglu", "rms_norm", "attention_varlen", "attention_paged", "linear_logprob"):
        assert callable(getattr(rk, name))


def test_gpu_checks_skip_without_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and HAS_TRITON:
        pytest.skip("a CUDA device is present: the harness would run, not skip")
    spec = importlib.util.spec_from_file_location("gpu_triton_checks", ROOT / "scripts" / "gpu_triton_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.run(tmp_path, sweep=False)
    assert "skipped" in res and res["skipped"]
    assert mod.main(["--out", str(tmp_path)]) == 0


_INTERPRET = textwrap.dedent('''
    import importlib.util, math, sys, torch
    spec = importlib.util.spec_from_file_location("rkt", sys.argv[1] + "/__init__.py", submodule_search_locations=[sys.argv[1]])
    rk = importlib.util.module_from_spec(spec); sys.modules["rkt"] = rk; spec.loader.exec_module(rk)
    C = rk.contracts
    from rkt import gemm
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
    out = torch.cat([rk.attention_paged(q[lo:hi], kc, vc, bt[:1], torch.tensor([hi]), torch.tensor([0, hi - lo]), config=acfg)
                     for lo, hi in ((0, 5), (5, 17), (17, 29))])
    assert torch.equal(out, full[:29])
    print("ok")
''')


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_under_triton_interpreter():
    """Index logic, masking and the prefill == decode == chunked-prefill == split property at tiny
    sizes on the CPU (the interpreter is numpy, so this proves the walk, not the GPU's bits)."""
    pytest.importorskip("torch")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRET, str(PKG)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]

"""The fast launch path (`rlkernel/backends/triton/launch.py`): it must launch the compiled kernel Triton's own
`kernel[grid](...)` would, for every specialization of the arguments (pointer alignment, integers equal to 1 or
multiples of 16, constexpr and option values), and step aside for launch hooks and the interpreter. On a GPU the
checks compare the compiled-kernel objects and the outputs (torch.equal); on a CPU-only machine the host helpers and
the interpreter's pass-through run, the GPU part skips."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import STUB_SM90_DRIVER, interpreter_env

ROOT = Path(__file__).resolve().parents[1]

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")


def test_host_helpers_equal_tritons():
    from rlkernel.backends.triton.launch import cdiv, next_pow2

    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 64, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in range(1, 70_000, 7):
        assert next_pow2(n) == triton.next_power_of_2(n), n
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 1024, 1025)] == [1, 2, 4, 4, 8, 1024, 2048]


_INTERPRETED = textwrap.dedent('''
    import torch, triton, triton.language as tl
    from rlkernel.backends.triton import launch
    from rlkernel.backends.triton import reduce as R

    @triton.jit
    def _add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1.0, mask=i < n)

    k = launch.fast(_add)
    assert not launch._fast_ok() and not k._jit  # the interpreter's function: Triton's own path
    x = torch.arange(37, dtype=torch.float32)
    y = torch.empty_like(x)
    k[(launch.cdiv(37, 16),)](x, y, 37, BLOCK=16)
    assert torch.equal(y, x + 1.0)
    assert isinstance(R._tree_rows_kernel_fast, launch.FastKernel) and R._tree_rows_kernel_fast.fn is R._tree_rows_kernel
    try:  # a benchmark cannot force the fast path where it cannot serve
        with launch.fast_path(True):
            raise AssertionError("fast_path(True) entered under the interpreter")
    except RuntimeError as e:
        assert "cannot serve" in str(e)
    with launch.fast_path(False):
        k[(launch.cdiv(37, 16),)](x, y, 37, BLOCK=16)
    assert launch._STATE["ok"] is False and torch.equal(y, x + 1.0)  # the process's own choice, restored
    print("ok")
''')


def test_interpreter_takes_tritons_own_path():
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=ROOT, env=interpreter_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_session.py launch_tests)")


@cuda
def test_fast_path_runs_tritons_kernel_for_every_specialization():
    from rlkernel.backends.reference import primitives as P
    from rlkernel.backends.triton import launch, norm, reduce as R

    assert launch._fast_ok(), "the fast path is off on this GPU machine (another Triton than 3.6?)"
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(9000 * 8 + 8, device="cuda", generator=g)  # room for the largest n * m below and an offset
    for n, m in ((1, 1), (16, 1), (17, 3), (1000, 64), (1024, 16), (4097, 5), (9000, 1)):
        for offset in (0, 1, 4):  # a data pointer 16-byte aligned or not (Triton specializes on it)
            x = base[offset:offset + n * m].view(n, m)
            first = R.tree_sum_rows(x)  # through the fast path (the second call served from its cache)
            again = R.tree_sum_rows(x)
            want = P.tree_sum_composition(x, dim=0)  # the contract's tree as torch ops
            log2r, c = R._shape(n, m)
            y = torch.empty((launch.cdiv(n, 1 << log2r), m), device="cuda")
            check = R._tree_rows_kernel_fast.verify(((launch.cdiv(n, 1 << log2r) * launch.cdiv(m, c)),), x, y, n, m,
                                                    launch.cdiv(m, c), C=c, R=1 << log2r, LOG2R=log2r, num_warps=4)
            assert check == {"fast_path": True, "cached": True, "same_kernel": True}, (n, m, offset, check)
            assert torch.equal(first.view(torch.int32), want.view(torch.int32))
            assert torch.equal(again.view(torch.int32), want.view(torch.int32))
    # a kernel with no do_not_specialize: integer arguments equal to 1 and multiples of 16 are specialized
    for rows, h in ((1, 1024), (16, 128), (17, 1000), (64, 4096)):
        for offset in (0, 3):
            x = torch.randn(rows * h + offset, device="cuda", generator=g)[offset:].view(rows, h)
            w = torch.randn(h, device="cuda", generator=g)
            kw = dict(HAS_RES=False, BLOCK=launch.next_pow2(h), num_warps=norm._warps(h), enable_fp_fusion=False)

            def args(y):
                return (x, x, w, y, x, h, x.stride(0), x.stride(0), y.stride(0), x.stride(0), 1e-6)

            check = norm._rmsnorm_kernel_fast.verify((rows,), *args(torch.empty_like(x)), **kw)
            assert check == {"fast_path": True, "cached": True, "same_kernel": True}, (rows, h, offset, check)
            fast_y, own_y = torch.empty_like(x), torch.empty_like(x)
            norm._rmsnorm_kernel_fast[(rows,)](*args(fast_y), **kw)
            norm._rmsnorm_kernel[(rows,)](*args(own_y), **kw)  # Triton's own launch writes the same bits
            assert torch.equal(fast_y.view(torch.int32), own_y.view(torch.int32))


@cuda
def test_first_launches_are_counted_once_per_specialization():
    """launch.first_launch_stats counts a (kernel, specialization) the first time the fast path runs it (what the
    trainer reports as a step's time_compile), and not again when it is served from the fast path's cache."""
    from rlkernel.backends.triton import launch, reduce as R

    x = torch.randn(333, 29, device="cuda")  # one launch of the tree kernel (<= 4,096 rows)
    launch.reset()  # the fast path forgets its kernels: the next launch of any specialization is a first one
    before = launch.first_launch_stats()
    R.tree_sum_rows(x)
    mid = launch.first_launch_stats()
    R.tree_sum_rows(x)
    R.tree_sum_rows(torch.randn(333, 29, device="cuda"))  # same specialization
    after = launch.first_launch_stats()
    assert mid["launches"] == before["launches"] + 1 and mid["seconds"] > before["seconds"]
    assert after == mid


@cuda
def test_launch_hooks_take_tritons_own_path():
    from triton import knobs

    from rlkernel.backends.triton import reduce as R

    x = torch.randn(300, 7, device="cuda")
    R.tree_sum_rows(x)  # cached
    seen = []

    def hook(metadata):
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        R.tree_sum_rows(x)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1  # the hook saw the launch: a profiler's view is never bypassed
    R.tree_sum_rows(x)
    assert len(seen) == 1


_GLUON_STUB = STUB_SM90_DRIVER + textwrap.dedent('''
    from rlkernel.backends.triton import attention_gluon as AG, contracts as C, launch

    if AG._IMPORT_ERROR is not None:
        print("skip: Gluon unavailable")
        raise SystemExit(0)

    q = torch.zeros(700, 32, 128, dtype=torch.bfloat16)
    k, v = torch.zeros(700, 8, 128, dtype=torch.bfloat16), torch.ones(700, 8, 128, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(700, 32)
    qs, ql = torch.tensor([0, 600, 699], dtype=torch.int32), torch.tensor([600, 99, 1], dtype=torch.int32)
    call = (q, k, v, out, qs, ql, ql, qs, 38, 128 ** -0.5, C.ATTENTION, k.stride(0), lse)
    if AG.CONSUMERS == 3:  # the library's kernel (RLKERNEL_ATTENTION_CONSUMERS): 38 tiles in groups of three
        grid, args, kwargs = AG._launch3_args(*call, 1, 0)
        jit, fastk, n_grid = AG.attention_gluon3._prefill3_kernel, AG._prefill3_fast, 13
    else:  # in pairs
        grid, args, kwargs = AG._launch_args(*call, AG.STAGES, 1, 0, 0, AG.QREG, AG.QK_FIRST)
        jit, fastk, n_grid = AG._prefill_kernel, AG._prefill_fast, 19
    cache, keys, _, _, binder = jit.device_caches[0]
    _, spec, options = binder(*args, **kwargs, debug=False, instrumentation_mode="")  # as JITFunction.run binds
    desc = f"tensordesc<bf16[64, 128],{AG.kv_layout(64, 128)!r}>"  # what precompile and compile_sm90 record
    assert spec[3][0] == spec[4][0] == desc, spec[3:5]
    cache[compute_cache_key(keys, spec, options)] = Kernel()  # "compiled" for these arguments
    assert launch._fast_ok() and isinstance(fastk, launch.FastKernel) and fastk._jit
    assert fastk.fn is jit
    for _ in range(3):
        AG.launch(*call)
    with launch.fast_path(False):
        AG.launch(*call)

    def plain(a):  # a descriptor as the launcher reads it (dataclass equality would compare tensors elementwise)
        if isinstance(a, AG.TensorDescriptor):
            return (id(a.base), tuple(a.shape), tuple(a.strides), tuple(a.block_shape), a.layout, a.padding)
        return id(a) if isinstance(a, torch.Tensor) else a

    via = [c[6] for c in calls]
    assert via == ["triton's own run", None, None, "triton's own run"], via
    assert all(c[:3] == (n_grid, 3, 8) and c[3:6] == (0, "function", "metadata") for c in calls), [c[:6] for c in calls]
    assert all(c[7] is None and c[8] is None for c in calls[1:3])  # the fast path launches without hooks
    assert all([plain(a) for a in c[9:]] == [plain(a) for a in calls[0][9:]] for c in calls)
    assert len(fastk._kernels) == 1 and launch.first_launch_stats()["launches"] == 1
    assert AG.kv_layout(64, 128) is AG.kv_layout(64, 128) and len(AG._LAYOUTS) == 1
    print("ok")
''')


@pytest.mark.parametrize("consumers", ["3", "2"])
def test_gluon_prefill_launches_through_the_fast_path(consumers):
    """attention_gluon.launch goes through launch.py's fast path: its first launch per specialization reaches the
    kernel Triton's own `JITFunction.run` holds for the arguments (found by Triton's own binder and cache key), later
    ones that same kernel directly, with the same launcher arguments (the two K / V tensor descriptors included), and
    `fast_path(False)` goes back to Triton's own run; for either kernel (RLKERNEL_ATTENTION_CONSUMERS: three consumer
    warpgroups, the library's since session 42, or two). Checked without a GPU: Triton's driver is a stub for sm_90 and
    its kernel cache holds a stand-in that records its launches (the GPU's check: scripts/gpu_gluon_attn.py,
    `fast_path` per case, and test_gluon_prefill_fast_path_runs_tritons_kernel)."""
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RLKERNEL_TRITON_FAST_LAUNCH")}
    env["RLKERNEL_ATTENTION_CONSUMERS"] = consumers
    proc = subprocess.run([sys.executable, "-c", _GLUON_STUB], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout[-1000:], proc.stderr[-3000:])


@cuda
def test_gluon_prefill_fast_path_runs_tritons_kernel():
    """On an H200, where the library takes the Gluon prefill: its fast-path launch runs the compiled kernel Triton's own
    launch picks (attention_gluon.verify), and the library call writes the same output and lse bits through either."""
    from rlkernel.backends.triton import attention as A, attention_gluon as AG, contracts as C, launch

    lens, hq, hkv, d = [600, 77, 1], 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(lens), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(lens), hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.tensor([0, 600, 677, 678], dtype=torch.int32, device="cuda")
    why = AG.unsupported_reason(q, k, C.ATTENTION, hq // hkv, d, paged=False, split=False, tma=True, walk="flat")
    if why is not None:
        pytest.skip(f"the library does not take the Gluon prefill here: {why}")
    y, lse = A.attention_varlen(q, k, v, cu, max_seqlen=600, return_lse=True)
    with launch.fast_path(False):
        own, own_lse = A.attention_varlen(q, k, v, cu, max_seqlen=600, return_lse=True)
    assert torch.equal(y.view(torch.int16), own.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), own_lse.view(torch.int32))
    out, out_lse = torch.empty_like(q), torch.empty_like(lse)
    qs, ql = cu[:-1].contiguous(), (cu[1:] - cu[:-1]).contiguous()
    check = AG.verify(q, k, v, out, qs, ql, ql, qs, launch.cdiv(600, 64 // (hq // hkv)), d ** -0.5, C.ATTENTION,
                      k.stride(0), out_lse)
    assert check == {"fast_path": True, "cached": True, "same_kernel": True}, check
    assert torch.equal(out.view(torch.int16), y.view(torch.int16))
    assert torch.equal(out_lse.view(torch.int32), lse.view(torch.int32))

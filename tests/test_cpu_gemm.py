"""Strict CPU GEMM (rlkernel/backends/cpu/csrc/gemm.cpp): bits under the contract.

Contract: C[m,n] = one float32 FMA chain over k ascending from +0.0f (inputs fp32/bf16/fp16
widened exactly; a NaN result is the canonical quiet NaN). Checked here:
  * exactness: the blocked SIMD kernels equal the scalar triple loop (rlkernel::matmul_naive),
    bit for bit, over odd shapes, strided/transposed operands, dtype mixes, special values;
    and the triple loop equals an exact-rational evaluation of the chain;
  * row invariance (a row's bits do not depend on M or its position), thread invariance;
  * ISA invariance: the library built with -march=x86-64-v2 (scalar std::fma), -march=haswell
    (AVX2+FMA) and -march=native (AVX-512 here) gives identical output hashes.

The library is built with torch.utils.cpp_extension into $RLKERNEL_BUILD_DIR (or
~/.cache/rlkernel)/gemm_<key>, key = source + flags + torch (+ CPU flags for -march=native),
once; a PID lock file guards concurrent builds and is broken when its owner is dead or old.
"""
from __future__ import annotations

import fractions
import hashlib
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "rlkernel" / "backends" / "cpu" / "csrc" / "gemm.cpp"
BASE_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]  # -fopenmp: at::parallel_for really runs threads
# The standalone build registers its ops under their own namespace, so this test can share a
# process (pytest session) with the project library, which links gemm.cpp into `rlkernel`.
OPS_NS = "rlkernel_gemm_standalone"
NS_FLAG = f"-DRK_GEMM_OPS_NAMESPACE={OPS_NS}"
LOCK_STALE_S = 900.0
LOCK_WAIT_S = 1200.0


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _key(march: str) -> str:
    h = hashlib.sha256()
    for part in (SRC.read_bytes(), (SRC.parent / "gemm.h").read_bytes(), " ".join(BASE_FLAGS + [NS_FLAG]).encode(), march.encode(),
                 torch.__version__.encode(), sys.version.encode()):
        h.update(part)
    if march == "native":
        h.update(" ".join(sorted(_cpu_flags())).encode())
    return h.hexdigest()[:16]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _BuildLock:
    """O_EXCL lock file holding 'pid time'; broken when the owner is dead or the lock is stale."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        deadline = time.time() + LOCK_WAIT_S
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                os.write(fd, f"{os.getpid()} {time.time()}".encode())
                os.close(fd)
                return self
            except FileExistsError:
                try:
                    pid_s, t_s = self.path.read_text().split()
                    stale = not _pid_alive(int(pid_s)) or time.time() - float(t_s) > LOCK_STALE_S
                except (OSError, ValueError):  # being written, or garbage: judge by age
                    try:
                        stale = time.time() - self.path.stat().st_mtime > 10
                    except OSError:
                        stale = False
                if stale:
                    try:
                        self.path.unlink()
                    except OSError:
                        pass
                    continue
                if time.time() > deadline:
                    raise TimeoutError(f"gave up waiting for build lock {self.path}")
                time.sleep(0.25)

    def __exit__(self, *exc):
        try:
            self.path.unlink()
        except OSError:
            pass


def build_library(march: str = "native") -> Path:
    """Compile (cached) and load the standalone GEMM library into this process (ops under
    torch.ops.rlkernel_gemm_standalone); returns the .so path."""
    key = _key(march)
    root = Path(os.environ.get("RLKERNEL_BUILD_DIR") or Path.home() / ".cache" / "rlkernel")
    d = root / f"gemm_{key}"
    name = f"rlkernel_gemm_{key}"
    lib = d / f"{name}.so"
    d.mkdir(parents=True, exist_ok=True)
    if not lib.exists():
        with _BuildLock(root / f"gemm_{key}.lock"):
            if not lib.exists():
                from torch.utils import cpp_extension

                bindir = str(Path(sys.executable).parent)  # ninja lives in the venv's bin/
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
                try:  # torch's own baton from a killed build would block forever; we hold the lock
                    (d / "lock").unlink()
                except OSError:
                    pass
                t = time.time()
                cpp_extension.load(name=name, sources=[str(SRC)], build_directory=str(d), extra_ldflags=["-fopenmp"],
                                   extra_cflags=BASE_FLAGS[:1] + [f"-march={march}"] + BASE_FLAGS[1:] + [NS_FLAG],
                                   is_python_module=False)
                (d / "build_seconds.txt").write_text(f"{time.time() - t:.1f}\n")
                return lib
    torch.ops.load_library(str(lib))
    return lib


# ---- the fixed hash suite (also run in subprocesses for the ISA builds) -------------------------
def int_tensor(shape, seed: int, dtype=torch.float32, mod: int = 1013) -> torch.Tensor:
    """Deterministic values from integers (no RNG): (i*7919 + seed*104729) % mod - mod//2, scaled by 1/64.

    mod 255 keeps the integers inside bf16/fp16's exact range."""
    n = math.prod(shape)
    i = torch.arange(n, dtype=torch.int64)
    v = ((i * 7919 + seed * 104729) % mod - mod // 2).to(torch.float32) / 64.0
    return v.reshape(shape).to(dtype)


def hash_suite(ops) -> dict:
    out = {}
    shapes = [(1, 1, 1), (3, 5, 7), (17, 33, 49), (9, 300, 130), (64, 1000, 300), (13, 257, 257), (2, 4096, 4096),
              (130, 576, 192)]
    dts = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    for (M, K, N) in shapes:
        for an, bn in [("f32", "f32"), ("bf16", "bf16"), ("f16", "bf16"), ("f32", "f16")]:
            if K * N > 1e6 and an != bn:
                continue
            mod = 1013 if "f32" == an else 255
            a = int_tensor((M, K), 1, dts[an], mod)
            # scale b by 1/3 (rounded once, deterministically) so the products carry full mantissas
            b = (int_tensor((N, K), 2, torch.float32, 1013 if bn == "f32" else 255) / 3.0).to(dts[bn]).t()
            h = hashlib.sha256()
            for t in (1, 3):
                torch.set_num_threads(t)
                h.update(ops.matmul(a, b).numpy().tobytes())
                h.update(ops.matmul(a, b.contiguous()).numpy().tobytes())
                h.update(ops.matmul_packed(a, ops.pack_b(b), N).numpy().tobytes())
                h.update(ops.matmul(b.t(), a.t()).numpy().tobytes())  # transposed a, row-major b
            if M * N * K <= 2e7:
                h.update(ops.matmul_naive(a, b).numpy().tobytes())
            out[f"{M}x{K}x{N}:{an}.{bn}"] = h.hexdigest()[:16]
    return out


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.equal(x.contiguous().view(torch.int32), y.contiguous().view(torch.int32))


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ops():
    build_library("native")
    return getattr(torch.ops, OPS_NS)


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _rand(shape, dtype, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


DT = [torch.float32, torch.bfloat16, torch.float16]


# ---- tests --------------------------------------------------------------------------------------
def test_isa_matches_cpu(ops):
    f = _cpu_flags()
    want = "avx512" if "avx512f" in f else ("avx2" if {"avx2", "fma"} <= f else "scalar")
    assert ops.matmul_isa() == want


def _f32_round(x: fractions.Fraction) -> float:
    """Round an exact rational to the nearest float32 (ties to even), as a Python float."""
    if x == 0:
        return 0.0
    s = -1.0 if x < 0 else 1.0
    x = abs(x)
    e = math.floor(math.log2(x.numerator) - math.log2(x.denominator))
    while fractions.Fraction(2) ** e > x:
        e -= 1
    while fractions.Fraction(2) ** (e + 1) <= x:
        e += 1
    q = fractions.Fraction(2) ** (max(e, -126) - 23)  # ulp (subnormals below 2^-126)
    n = x / q
    fl = math.floor(n)
    rem = n - fl
    if rem > fractions.Fraction(1, 2) or (rem == fractions.Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    v = fl * q
    if v >= fractions.Fraction(2) ** 128:
        return s * math.inf
    return s * float(v)


def test_naive_is_the_exact_chain(ops):
    """The scalar reference equals the chain evaluated with exact rationals and one float32 rounding per step."""
    g = torch.Generator().manual_seed(1)
    for (M, K, N) in [(2, 9, 3), (1, 33, 2)]:
        a = torch.randn(M, K, generator=g) * torch.logspace(-6, 6, K)
        b = torch.randn(K, N, generator=g)
        c = ops.matmul_naive(a, b)
        for m in range(M):
            for n in range(N):
                acc = 0.0
                for k in range(K):
                    acc = _f32_round(fractions.Fraction(float(a[m, k])) * fractions.Fraction(float(b[k, n])) +
                                     fractions.Fraction(acc))
                assert struct.pack("<f", acc) == struct.pack("<f", float(c[m, n])), (m, n)


SHAPES = [(1, 1, 1), (1, 7, 5), (2, 3, 17), (3, 5, 7), (7, 1, 33), (8, 16, 16), (9, 17, 15), (13, 64, 47), (17, 33, 49),
          (31, 100, 96), (64, 257, 130), (100, 17, 300), (1, 4096, 4096), (3, 4096, 4096), (129, 31, 64)]


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_exact_vs_naive(ops, M, K, N):
    g = torch.Generator().manual_seed(M * 1000 + K * 10 + N)
    big = M * K * N > 1e7
    combos = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)] if big else \
        [(da, db) for da in DT for db in DT]
    for da, db in combos:
        a = _rand((M, K), da, g)
        b = _rand((K, N), db, g)
        ref = ops.matmul_naive(a, b)
        w = b.t().contiguous()  # weight [N, K]: the linear layer's b = w.t()
        cases = {
            "rowmajor": (a, b),
            "b=w.t()": (a, w.t()),
            "a transposed": (a.t().contiguous().t(), b),
        }
        if not big:
            a2 = _rand((2 * M, 3 * K), da, g)
            a2[::2, 1::3] = a.to(da)
            b2 = _rand((2 * K, 3 * N + 1), db, g)
            b2[::2, 1::3] = b
            cases["strided"] = (a2[::2, 1::3], b2[::2, 1::3])
        for name, (x, y) in cases.items():
            assert _bits_equal(ops.matmul(x, y), ref), (name, da, db)
        assert _bits_equal(ops.matmul_packed(a, ops.pack_b(b), N), ref), ("packed", da, db)
        assert _bits_equal(ops.matmul_packed(a, ops.pack_b(w.t()), N), ref), ("packed w.t()", da, db)
        if db == torch.bfloat16:  # float32 packing of bf16 weights: same bits
            assert _bits_equal(ops.matmul_packed(a, ops.pack_b(b.float()), N), ref), ("packed f32 of bf16", da)


def test_dx_and_dw_layouts(ops):
    """The training GEMMs: y = x W^T, dx = g W, dW = g^T x, all against the triple loop."""
    g = torch.Generator().manual_seed(7)
    T, Din, Dout = 37, 130, 96
    for dt in DT:
        x, W, gr = _rand((T, Din), dt, g), _rand((Dout, Din), dt, g), _rand((T, Dout), dt, g)
        for a, b in [(x, W.t()), (gr, W), (gr.t(), x)]:
            assert _bits_equal(ops.matmul(a, b), ops.matmul_naive(a, b))


def test_special_values(ops):
    vals = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 3.0e38, -3.0e38, 1e-40, -1e-40, 1.4e-45, 65504.0,
            6e-8, 2.0**-126, 0.1]
    g = torch.Generator().manual_seed(3)
    M, K, N = 9, 23, 37
    idx_a = torch.randint(0, len(vals), (M, K), generator=g)
    idx_b = torch.randint(0, len(vals), (K, N), generator=g)
    v = torch.tensor(vals, dtype=torch.float32)
    a32 = torch.where(torch.rand(M, K, generator=g) < 0.5, v[idx_a], torch.randn(M, K, generator=g))
    b32 = torch.where(torch.rand(K, N, generator=g) < 0.3, v[idx_b], torch.randn(K, N, generator=g))
    # rows / columns with only finite values too, so results are a mix of finite, inf and NaN
    a32[0] = torch.randn(K, generator=g) * 1e30
    b32[:, 0] = torch.randn(K, generator=g) * 1e10
    a32[1] = -0.0
    b32[:, 1] = 0.0
    for da in DT:
        for db in DT:
            a, b = a32.to(da), b32.to(db)
            ref = ops.matmul_naive(a, b)
            assert _bits_equal(ops.matmul(a, b), ref), (da, db)
            assert _bits_equal(ops.matmul(a, b.t().contiguous().t()), ref), (da, db)
            assert _bits_equal(ops.matmul_packed(a, ops.pack_b(b), N), ref), (da, db)
            nan = torch.isnan(ref)
            assert nan.any() and (~nan).any()
            assert (ref.view(torch.int32)[nan] == 0x7FC00000).all()  # canonical NaN
    # signed zeros: fma(-0, 1, +0) = +0 (the chain starts at +0.0f) ...
    z = ops.matmul(torch.full((1, 3), -0.0), torch.ones(3, 2))
    assert (z.view(torch.int32) == 0).all()
    # ... but an exact product that underflows keeps its sign: fma(-1e-30, 1e-30, +0) = -0
    t = ops.matmul(torch.tensor([[-1e-30]]), torch.tensor([[1e-30]]))
    assert t.view(torch.int32).item() == -2**31


def test_k_split_accumulate(ops):
    """matmul_out(accumulate=True) carries the chain: ascending K pieces give the one-call bits."""
    g = torch.Generator().manual_seed(11)
    for dt in DT:
        a, b = _rand((19, 300), dt, g), _rand((300, 70), dt, g)
        ref = ops.matmul(a, b)
        out = torch.empty(19, 80)[:, 5:75]  # row stride 80
        ops.matmul_out(a[:, :77], b[:77], out)
        ops.matmul_out(a[:, 77:256], b[77:256], out, True)
        ops.matmul_out(a[:, 256:], b[256:], out, True)
        assert _bits_equal(out, ref)
    assert _bits_equal(ops.matmul(torch.ones(2, 0), torch.ones(0, 3)), torch.zeros(2, 3))


def test_packed_checks(ops):
    b = torch.randn(10, 20)
    p = ops.pack_b(b)
    assert p.shape == (2, 10, 16) and p.dtype == torch.float32
    pb = ops.pack_b(b.bfloat16())
    assert pb.shape == (2, 5, 32) and pb.dtype == torch.bfloat16
    assert ops.pack_b(torch.randn(11, 20).bfloat16()).shape == (2, 6, 32)
    with pytest.raises(RuntimeError):
        ops.matmul_packed(torch.randn(3, 11), p, 20)  # wrong K
    with pytest.raises(RuntimeError):
        ops.matmul_packed(torch.randn(3, 10), p, 33)  # wrong N
    with pytest.raises(RuntimeError):
        ops.matmul(torch.randn(3, 10, dtype=torch.float64), b)


@pytest.mark.parametrize("K,N,Ms", [(1000, 300, list(range(1, 258))),
                                    (4096, 4096, [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 24, 31, 33, 48, 64, 65, 100, 129, 257])])
def test_row_invariance(ops, K, N, Ms):
    """Each row's bits equal the M=1 result, for every M and every position in the batch."""
    g = torch.Generator().manual_seed(K + N)
    Mmax = max(Ms)
    for dt in (torch.float32, torch.bfloat16):
        x = _rand((Mmax, K), dt, g)
        w = _rand((N, K), dt, g, K ** -0.5)
        pw = ops.pack_b(w.t())
        single = torch.cat([ops.matmul_packed(x[i:i + 1], pw, N) for i in range(Mmax)])
        assert _bits_equal(single[:3], ops.matmul_naive(x[:3], w.t()))
        for M in Ms:
            assert _bits_equal(ops.matmul_packed(x[:M], pw, N), single[:M]), (dt, M)
            if K * N < 1e6 or M in (1, 16, 257):
                assert _bits_equal(ops.matmul(x[:M], w.t()), single[:M]), (dt, M, "plain")
        # a given row at every position of a batch
        if K * N < 1e6:
            r = x[5:6]
            for M in (2, 9, 33):
                for pos in range(M):
                    batch = x[10:10 + M].clone()
                    batch[pos] = r[0]
                    assert _bits_equal(ops.matmul_packed(batch, pw, N)[pos:pos + 1], single[5:6]), (dt, M, pos)


def test_thread_invariance(ops):
    g = torch.Generator().manual_seed(5)
    cases = []
    for (M, K, N) in [(1, 576, 3072), (16, 1000, 300), (37, 300, 1000), (256, 576, 576), (600, 200, 130)]:
        for dt in (torch.float32, torch.bfloat16):
            x, w = _rand((M, K), dt, g), _rand((N, K), dt, g)
            cases.append((x, w, ops.pack_b(w.t())))
    refs = None
    for t in (1, 2, 3, 4, 8):
        torch.set_num_threads(t)
        got = []
        for x, w, pw in cases:
            got += [ops.matmul(x, w.t()), ops.matmul_packed(x, pw, w.shape[0]), ops.matmul(x.t().contiguous().t(), w.t().contiguous())]
        if refs is None:
            refs = got
        else:
            assert all(_bits_equal(a, b) for a, b in zip(got, refs)), t


_SUBPROC = r"""
import json, sys, time
sys.path.insert(0, {testdir!r})
import torch
import test_cpu_gemm as T
t = time.time()
lib = T.build_library({march!r})
built = time.time() - t
ops = getattr(torch.ops, T.OPS_NS)
t = time.time()
h = T.hash_suite(ops)
print("RESULT " + json.dumps(dict(isa=ops.matmul_isa(), hashes=h, load_s=built, suite_s=time.time() - t)))
"""


def test_isa_variants_same_bits():
    """x86-64-v2 (scalar std::fma), haswell (AVX2+FMA), native (AVX-512 here): identical hashes."""
    f = _cpu_flags()
    marches = ["x86-64-v2"]
    if {"avx2", "fma", "f16c", "bmi2"} <= f:
        marches.append("haswell")
    marches.append("native")
    procs = {}
    for m in marches:  # concurrently: the builds are the slow part
        code = _SUBPROC.format(testdir=str(Path(__file__).parent), march=m)
        procs[m] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = {}
    for m, p in procs.items():
        out, err = p.communicate(timeout=1800)
        assert p.returncode == 0, f"{m}: {err[-3000:]}"
        line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
        res[m] = json.loads(line[len("RESULT "):])
    expect = {"x86-64-v2": "scalar", "haswell": "avx2"}
    for m, r in res.items():
        if m in expect:
            assert r["isa"] == expect[m], (m, r["isa"])
        print(f"{m}: isa={r['isa']} build/load {r['load_s']:.1f}s suite {r['suite_s']:.1f}s")
    base = res[marches[0]]["hashes"]
    for m in marches[1:]:
        diff = [k for k in base if base[k] != res[m]["hashes"].get(k)]
        assert not diff, f"{m} differs from {marches[0]} on {diff}"

"""The strict GEMM's Gluon tiles (rlkernel/backends/triton/gemm_gluon.py), checked on a machine without a GPU: the rule
that picks them reproduces session 28's measured wins and nothing else, every tile compiles for sm_90 with the
instructions its claim rests on, the dispatch refuses what it was not checked on, and gemm.matmul's "warpspec"
schedule falls back to "scratch" (same bits) where no Gluon tile serves. Their bits and speed are the H200's to tell
(`scripts/gpu_gluon_gemm.py`, `gpu_session.py gluon_gemm` / `strict_recheck`; a first-use check at run time)."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from rlkernel.backends.triton import gemm_gluon as GG  # noqa: E402
from helpers import STUB_SM90_DRIVER, compile_sm90_or_skip, ptxas_usage, wgmma_scale_d_not_always_on  # noqa: E402

QKV, O, GATE_UP, DOWN, LM_HEAD = (4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)  # (K, N)


def test_the_rule_picks_the_measured_tiles_only():
    """session 28 call 2 (H200, 132 SMs): 128 x 96 beat the Triton table at qkv M = 256, 128 x 192 at qkv M = 1,024
    and gate_up M = 256, and lost or tied at M = 4,096 and gate_up M = 1,024; the segmented consumer beat scratch at
    o / down M = 256 (64 x 128), 1,024 and 4,096 (128 x 128); session 29: 64 x 192 (6 stages) beat 128 x 96 at qkv
    M = 256, 128 x 192 with 5 stages beat 4, and from M = 512 128 x 128 persistent in groups of 8 M tiles beat 64 x 128
    and one program a tile."""
    def name(m, kn, segs=1, sms=132):
        t = GG.pick(m, kn[1], kn[0], segs, sms)
        return t and t.name

    assert name(256, QKV) == "64x192_s7" and name(200, QKV) == "64x192_s7"
    assert name(512, QKV) == name(1024, QKV) == name(256, GATE_UP) == "128x192_s5_p"
    assert name(4096, QKV) is None and name(1024, GATE_UP) is None and name(4096, GATE_UP) is None
    assert name(256, O) is None and name(256, DOWN) is None  # no segments at widths no tile divides: Triton
    assert name(128, QKV) is None and name(64, QKV) is None  # decode sizes: not raced
    assert name(256, (2048, 6144)) is None  # K below the measured 4,096
    assert name(256, QKV, sms=78) == "128x192_s5_p"  # fewer SMs: 64 x 192's 128 tiles are more than a wave
    for kn in (O, DOWN):
        assert name(129, kn, 4) == name(256, kn, 4) == "seg4_64x128"
        assert name(257, kn, 4) == name(512, kn, 4) == name(4096, kn, 4) == name(16384, kn, 4) == "seg4_128x128_p"
        assert name(128, kn, 4) is None and name(256, kn, 2) is None and name(256, kn, 8) is None
    assert name(256, (4096 + 64, 4096), 4) is None  # a segment that is not whole K steps
    assert name(256, LM_HEAD) == name(129, LM_HEAD) == "128x256_p"  # session 29 call 5: 0.93x vs the table's 0.86x
    assert name(512, LM_HEAD) is None and name(1024, LM_HEAD) is None  # the table won at 1,024 (512 not raced)
    assert name(256, (4096, 32768)) is None  # a narrower N: not raced


def _compiled(tile):
    return compile_sm90_or_skip(lambda: GG.compile_sm90(tile))


def _arith(k):
    """A compiled kernel's wgmma chains and every fp32 op on its accumulators, in program order (what the knobs must
    leave as the default tile has them)."""
    return (re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+", k.asm["ptx"]),
            re.findall(r"= (?:arith|math)\.\w+ %\S+(?:, %\S+)* : tensor<\d+x\d+xf32", k.asm["ttgir"]))


def test_segments_over_two_accumulators_are_gemm_parks():
    """This kernel folds one accumulator's segments in registers; two accumulators' tree partials must wait outside
    them (gemm_park's kernel, tests/test_gemm_park.py): such a Tile is refused here, not compiled into spills."""
    with pytest.raises(ValueError, match="gemm_park"):
        GG.Tile("seg4_128x192_p", 128, 128, 64, 3, 4, 8, persistent=True, group_m=8)
    assert GG.Tile("128x192", 128, 128, 64, 4, 1, 8).bn == 192 and GG.Tile("seg4", 128, 128, 0, 4, 4, 8).segs == 4


@pytest.mark.parametrize("tile", GG.TILES, ids=lambda t: t.name)
def test_every_tile_compiles_for_sm90_as_claimed(tile):
    """Each accumulator one wgmma chain of its own width (64 + 32, 128 + 64, 128), A and W through TMA, the producer
    warp's register hand-over, no spills and no wgmma serialised for want of registers (ptxas C7512); the segment
    tree is exactly its three fp32 adds ((s0 + s1) + (s2 + s3)) and nothing else touches the accumulators' values
    (no multiply, no fma: the products reach the sum only through the wgmma chain); every wgmma adds onto the
    accumulator (scale-d fixed true), which starts at +0."""
    pytest.importorskip("triton.experimental.gluon")
    if GG._IMPORT_ERROR is not None:
        pytest.skip(GG._IMPORT_ERROR)
    k = _compiled(tile)
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    widths = {int(w) for w in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16", ptx)}
    assert widths == {tile.bn1} | ({tile.bn2} if tile.bn2 else set()), widths
    assert "setmaxnreg" in ptx and ptx.count("cp.async.bulk.tensor") >= (3 if tile.bn2 else 2)
    usage = ptxas_usage(ptx)
    assert "0 bytes spill stores" in usage and "C7512" not in usage, usage
    adds = len(re.findall(r"= arith\.addf %\S+, %\S+ : tensor<\d+x\d+xf32", ttgir))
    assert adds == (3 * (2 if tile.bn2 else 1) if tile.segs == 4 else 0), adds  # the tree's adds per accumulator
    assert not re.search(r"= (arith\.mulf|math\.fma) .*tensor<\d+x\d+xf32", ttgir)
    # every chain adds onto its zeroed accumulator (the contract's "from +0.0", as the Triton kernel: an all -0 chain
    # gives +0); the control: the same PTX with that predicate computed is caught
    assert not wgmma_scale_d_not_always_on(ptx)
    fixed = re.search(r"mov\.pred\s+(%p\d+),\s*-1;", ptx)
    assert wgmma_scale_d_not_always_on(ptx.replace(fixed.group(0), f"setp.eq.s32 {fixed.group(1)}, %r1, 0;"))


def test_depth_and_pdl_move_no_arithmetic_and_stay_off_the_library_tiles():
    """Session 49's two knobs (scripts/gpu_gluon_gemm.py timed them on an H100: no gain, so no library tile takes
    them). `depth` only moves when a stage is freed: the wgmma wait lets 2 x depth groups stay in flight (two
    accumulators) and the wgmma chains, their widths and every add are as at depth 1; `pdl` adds griddepcontrol
    (wait before any load, launch_dependents) and the launch attribute, nothing in the arithmetic. A default tile
    compiles without either (its specialization, and the recipe seed's entries of it, as before). Bad values refused."""
    pytest.importorskip("triton.experimental.gluon")
    if GG._IMPORT_ERROR is not None:
        pytest.skip(GG._IMPORT_ERROR)
    with pytest.raises(ValueError, match="depth"):
        GG.Tile("seg_d2", 128, 128, 0, 4, 4, 8, depth=2)  # the segment fold waits for each segment's chain
    with pytest.raises(ValueError, match="depth"):
        GG.Tile("d0", 64, 128, 64, 7, 1, 4, depth=0)
    with pytest.raises(ValueError, match="pdl"):
        GG.Tile("p3", 64, 128, 64, 7, 1, 4, pdl=3)
    assert all(t.depth == 1 and t.pdl == 0 for t in GG.TILES)
    short = torch.zeros(64, 6 * GG.BK, dtype=torch.bfloat16)  # pdl 2's prologue needs K >= stages x BK
    with pytest.raises(ValueError, match="pdl 2"):
        GG._launch_args(short, short, GG.Tile("p2", 64, 128, 64, 7, 1, 4, pdl=2), short)
    assert GG._knobs(GG.ONE_WAVE) == {} and GG._knobs(GG.Tile("x", 64, 128, 64, 7, 1, 4, depth=2, pdl=1)) == \
        {"DEPTH": 2, "PDL": 1, "launch_pdl": True}

    def waits(ptx):
        return sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)})

    base = _compiled(GG.ONE_WAVE)
    deep = _compiled(GG.Tile("64x192_s7_d2", 64, 128, 64, 7, 1, 4, depth=2))
    pdl = _compiled(GG.Tile("64x192_s7_pdl1", 64, 128, 64, 7, 1, 4, pdl=1))
    assert waits(base.asm["ptx"]) == [0, 2] and waits(deep.asm["ptx"]) == [0, 4]  # two accumulators a step
    assert "griddepcontrol" not in base.asm["ptx"] and not base.metadata.launch_pdl
    assert pdl.asm["ptx"].count("griddepcontrol.wait") == 2 and "griddepcontrol.launch_dependents" in pdl.asm["ptx"]
    assert pdl.metadata.launch_pdl

    assert _arith(deep) == _arith(base) == _arith(pdl)
    assert len(_arith(base)[0]) == 8 and len(_arith(base)[1]) == 2  # 4 k16 steps x 2 widths; the two bf16 roundings
    assert waits(pdl.asm["ptx"]) == waits(base.asm["ptx"])  # the control: the wait is what depth changes


def test_l2_prefetch_knob_adds_one_tensor_hint_a_round_and_no_arithmetic():
    """`prefetch` (an experiment): one lane of the producer warp asks L2 for the tile's W rows x the next
    PREFETCH_STEPS steps' columns ahead of its TMA loads — one cp.async.bulk.prefetch.tensor a round through W's own
    tensor map, behind one tensormap-proxy fence — and nothing else moves: the wgmma chains and every fp32 op are the
    default tile's. No library tile takes it; bad values are refused. (Session 50's version, one 512-byte
    cp.async.bulk.prefetch.L2 a W row, ran ~2x slower on an H100: its PTX must not come back.)"""
    pytest.importorskip("triton.experimental.gluon")
    if GG._IMPORT_ERROR is not None:
        pytest.skip(GG._IMPORT_ERROR)
    for bad in (-4, 3, 6):
        with pytest.raises(ValueError, match="prefetch"):
            GG.Tile("pf", 128, 128, 64, 5, 1, 8, prefetch=bad)
    with pytest.raises(ValueError, match="256 W rows"):  # a tensor map's box holds at most 256 rows
        GG.Tile("pf", 128, 256, 64, 4, 1, 8, prefetch=8)
    assert all(t.prefetch == 0 for t in GG.TILES)
    tile = GG.Tile("128x192_s5_p_pf8", 128, 128, 64, 5, 1, 8, persistent=True, group_m=8, prefetch=8)
    assert GG._knobs(tile) == {"PREFETCH": 8} and "PREFETCH" not in GG._knobs(GG.TWO_WAVES)

    base, pf = _compiled(GG.TWO_WAVES), _compiled(tile)
    ptx = pf.asm["ptx"]
    hints = re.findall(r"@(%?\w+) cp\.async\.bulk\.prefetch\.tensor\.2d\.L2\.global\.tile "
                       r"\[%rd\d+, \{%r\d+, %r\d+\}\];", ptx)
    assert len(hints) == 1, hints  # one request a round, predicated ...
    lane0 = r"mov\.u32 \w+, %laneid;\s*setp\.eq\.u32 " + re.escape(hints[0]) + r", \w+, 0;"
    assert re.search(lane0, ptx)  # ... on lane 0
    assert len(re.findall(r"fence\.proxy\.tensormap::generic\.acquire\.gpu \[%rd\d+\], 128;", ptx)) == 1
    assert "cp.async.bulk.prefetch.L2" not in ptx  # session 50's per-row requests are gone
    assert "prefetch" not in base.asm["ptx"] and "tensormap::" not in base.asm["ptx"]  # the control: none by default
    assert _arith(pf) == _arith(base) and len(_arith(base)[0]) == 8
    assert re.search(r"\b0 bytes spill stores", ptxas_usage(ptx))


def test_l2_prefetch_tensor_map_is_encoded_over_w_as_stored():
    """The prefetch's tensor map: cuTensorMapEncodeTiled (libcuda, absent here, so its arguments are what is checked)
    over W [N, K] as it lies — dims (K, N), row stride in bytes, a box of PREFETCH_STEPS x BK columns x the tile's
    rows, bf16, no swizzle — and the 128 bytes it writes are the map; a failing encode and a W a map cannot describe
    are refused with their reasons."""
    import ctypes

    seen = {}

    def encode(ref, dtype, rank, addr, dims, strides, box, estrides, interleave, swizzle, l2, oob):
        assert ref.value % 64 == 0  # cuda.h: a CUtensorMap is 64-byte aligned
        seen.update(dtype=dtype.value, rank=rank.value, addr=addr.value, dims=list(dims), strides=list(strides),
                    box=list(box), estrides=list(estrides),
                    modes=(interleave.value, swizzle.value, l2.value, oob.value))
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_uint64 * 16)).contents[:] = list(range(100, 116))
        return 0

    w = torch.zeros(24576, 4096, dtype=torch.bfloat16)
    raw = GG.prefetch_map_bytes(w, 192, encode)
    assert seen == dict(dtype=9, rank=2, addr=w.data_ptr(), dims=[4096, 24576], strides=[8192],
                        box=[GG.PREFETCH_STEPS * GG.BK, 192], estrides=[1, 1], modes=(0, 0, 3, 0))
    assert raw == bytes((ctypes.c_uint64 * 16)(*range(100, 116)))
    sliced = torch.zeros(512, 2 * 4096, dtype=torch.bfloat16)[:, :4096]  # rows of stride 8,192 elements
    GG.prefetch_map_bytes(sliced, 128, encode)
    assert seen["dims"] == [4096, 512] and seen["strides"] == [16384]
    with pytest.raises(RuntimeError, match="CUresult 1"):
        GG.prefetch_map_bytes(w, 192, lambda *a: 1)
    for bad, rows in ((torch.zeros(64, 4100, dtype=torch.bfloat16), 64),  # a row of 8,200 bytes: not 16's multiple
                      (torch.zeros(64, 4096, dtype=torch.float32), 64), (w, 257), (w.t(), 64)):
        with pytest.raises(ValueError, match="tensor map"):
            GG.prefetch_map_bytes(bad, rows, encode)
    m = GG.prefetch_map(w, 192, encode)
    assert m.dtype == torch.uint8 and bytes(m.tolist()) == raw and GG.prefetch_map(w, 192) is m  # cached


def test_choose_and_its_reasons_on_what_it_was_not_checked_on():
    """Every refusal is named before any device query; on a CPU tensor `choose` serves nothing."""
    a, w = torch.zeros(256, 4096, dtype=torch.bfloat16), torch.zeros(6144, 4096, dtype=torch.bfloat16)
    assert GG.choose(a, w, 1, None, None) is None  # not CUDA
    if GG._IMPORT_ERROR is not None:
        assert GG.unsupported_reason(a, w, GG.ONE_WAVE).startswith("Gluon unavailable")
        return
    assert GG.unsupported_reason(a.float(), w.float(), GG.ONE_WAVE) == "not bf16 in and out"
    assert GG.unsupported_reason(a, w, GG.ONE_WAVE, out_dtype=torch.float32) == "not bf16 in and out"
    assert GG.unsupported_reason(a[:, 1:], w[:, 1:], GG.ONE_WAVE) == "operands not loadable through TMA"
    assert GG.unsupported_reason(a, w, GG.ONE_WAVE, out=torch.zeros(6144, 256, dtype=torch.bfloat16).t()) == \
        "operands not loadable through TMA"
    GG._CHECKING.append(True)  # while the first-use check runs its reference: every call takes the Triton kernel
    try:
        assert GG.unsupported_reason(a, w, GG.ONE_WAVE) == "first-use check running (its Triton side)"
    finally:
        GG._CHECKING.clear()
    with GG.off():
        assert GG.unsupported_reason(a, w, GG.ONE_WAVE) == f"{GG.ENV}=0" and GG.describe() == f"off ({GG.ENV}=0)"
    saved = dict(GG._CHECKED)
    GG._CHECKED.update({(0, "128x96"): None, (0, "seg4_64x128"): "first-use check: 3 of 1152 values differ"})
    try:  # provenance names each check's outcome
        d = GG.describe()
        assert d.startswith("on where picked") and "cuda:0 128x96: bit-equal to Triton" in d and "3 of 1152" in d
    finally:
        GG._CHECKED.clear()
        GG._CHECKED.update(saved)


def test_warpspec_falls_back_to_scratch_with_its_bits():
    """Where no Gluon tile serves (here: no GPU), gemm.matmul's "warpspec" runs "scratch": the same output, bit for
    bit, and the same bits as one plain GEMM per segment summed by the tree ("launches"). Under the interpreter."""
    from helpers import run_interpreted

    out = run_interpreted(
        "import torch\n"
        "from rlkernel.backends.triton import gemm\n"
        "g = torch.Generator().manual_seed(3)\n"
        "a = torch.randn(40, 256, generator=g); w = torch.randn(48, 256, generator=g)\n"
        "ws = gemm.matmul(a, w, k_segments=4, schedule='warpspec')\n"
        "print('scratch', torch.equal(ws, gemm.matmul(a, w, k_segments=4, schedule='scratch')))\n"
        "print('launches', torch.equal(ws, gemm.matmul(a, w, k_segments=4, schedule='launches')))\n"
        "print('plain', torch.equal(ws, gemm.matmul(a, w)))\n")
    assert "scratch True" in out and "launches True" in out
    assert "plain False" in out  # the negative control: one K loop from zero is another order


_STUB = STUB_SM90_DRIVER + '''
from rlkernel.backends.triton import gemm_gluon as GG, launch

if GG._IMPORT_ERROR is not None:
    print("skip: Gluon unavailable")
    raise SystemExit(0)

a, w = torch.zeros(300, 4096, dtype=torch.bfloat16), torch.zeros(6144, 4096, dtype=torch.bfloat16)
out = torch.empty(300, 6144, dtype=torch.bfloat16)
grid, args, kwargs = GG._launch_args(a, w, GG.ONE_WAVE, out)
tiles = -(-300 // GG.ONE_WAVE.bm) * (6144 // GG.ONE_WAVE.bn)
assert grid == (tiles,) and args[-1] == tiles, (grid, args[-1])  # one tile a program: step = the tile count
GG._SMS[-1] = 132  # a persistent tile: one program per SM (the H200's 132), each stepping over the grid
pgrid, pargs, _ = GG._launch_args(a, w, GG.Tile("p", 128, 64, 32, 5, 1, 8, persistent=True, group_m=8), out)
assert pgrid == (132,) and pargs[-1] == 132, (pgrid, pargs[-1])
cgrid, cargs, _ = GG._launch_args(a, w, GG.ONE_WAVE, out, programs=2)  # the first-use check's second launch
assert cgrid == (2,) and cargs[-1] == 2, (cgrid, cargs[-1])
cache, keys, _, _, binder = GG._gemm_kernel.device_caches[0]
_, spec, options = binder(*args, **kwargs, debug=False, instrumentation_mode="")
pf = GG.Tile("pf", 128, 128, 64, 5, 1, 8, persistent=True, group_m=8, prefetch=8)
pf_map = GG.prefetch_map(w, pf.bn, encode=lambda *a: 0)  # (libcuda's encoder is absent here: zero bytes)
_, fargs, fkw = GG._launch_args(a, w, pf, out)  # the L2 prefetch's map: a pointer argument beside the descriptors
assert fkw["pf_map"] is pf_map and fkw["PREFETCH"] == 8 and "pf_map" not in kwargs, (sorted(fkw), sorted(kwargs))
_, fspec, _ = binder(*fargs, **fkw, debug=False, instrumentation_mode="")
assert len(fspec) == len(spec) and fspec != spec, (fspec, spec)
cache[compute_cache_key(keys, spec, options)] = Kernel()
assert launch._fast_ok() and isinstance(GG._gemm_fast, launch.FastKernel) and GG._gemm_fast.fn is GG._gemm_kernel
for _ in range(3):
    GG.launch(a, w, GG.ONE_WAVE, out)
with launch.fast_path(False):
    GG.launch(a, w, GG.ONE_WAVE, out)

def plain(x):
    if isinstance(x, GG.TensorDescriptor) if hasattr(GG, "TensorDescriptor") else type(x).__name__ == "TensorDescriptor":
        return (id(x.base), tuple(x.shape), tuple(x.strides), tuple(x.block_shape), x.layout)
    return id(x) if isinstance(x, torch.Tensor) else x

via = [c[6] for c in calls]
assert via == ["triton's own run", None, None, "triton's own run"], via
assert all(c[:3] == (tiles, 1, 1) for c in calls), [c[:3] for c in calls]
assert all([plain(x) for x in c[9:]] == [plain(x) for x in calls[0][9:]] for c in calls)
assert len(GG._gemm_fast._kernels) == 1
print("ok")
'''


def test_gluon_gemm_launches_through_the_fast_path():
    """gemm_gluon.launch goes through launch.py's fast path as the Gluon prefill does: the first launch per
    specialization reaches the kernel Triton's own run holds for the arguments, later ones that kernel directly with
    the same launcher arguments (the tensor descriptors included), `fast_path(False)` goes back. Without a GPU: Triton's
    driver is a stub for sm_90 and its cache holds a stand-in that records launches (tests/test_triton_launch.py's
    method; on a GPU, gemm_gluon.verify)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.experimental.gluon")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RLKERNEL_TRITON_FAST_LAUNCH")}
    proc = subprocess.run([sys.executable, "-c", _STUB], cwd=root, env={**env, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout[-1000:], proc.stderr[-3000:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gluon_gemm_fast_path_runs_tritons_kernel_and_the_contracts_bits():
    """On an H200: each tile's fast-path launch runs the compiled kernel Triton's own launch picks (gemm_gluon.verify),
    and gemm.matmul's Gluon output equals the Triton kernel's bit for bit (RLKERNEL_GEMM_GLUON off for the reference)."""
    from rlkernel.backends.triton import gemm

    g = torch.Generator(device="cuda").manual_seed(0)
    for tile, (m, n, segs) in ((GG.ONE_WAVE, (256, 6144, 1)), (GG.TWO_WAVES, (1024, 6144, 1)),
                               (GG.SEG_64x128, (256, 4096, 4)), (GG.SEG_128x128, (1024, 4096, 4)),
                               (GG.VOCAB, (256, GG.VOCAB_MIN_N + 8, 1))):  # (a partial last N tile)
        a = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16, generator=g) / 64
        if GG.choose(a, w, segs, None, None) != tile:
            pytest.skip(f"the library does not take {tile.name} here: {GG.unsupported_reason(a, w, tile)}")
        y = gemm.matmul(a, w, k_segments=segs, schedule="warpspec" if segs > 1 else None)
        with GG.off():
            ref = gemm.matmul(a, w, k_segments=segs, schedule="scratch" if segs > 1 else None)
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), tile.name
        out = torch.empty_like(y)
        assert GG.verify(a, w, tile, out) == {"fast_path": True, "cached": True, "same_kernel": True}, tile.name
        assert torch.equal(out.view(torch.int16), y.view(torch.int16)), tile.name


def test_the_gluon_kernels_first_use_bookkeeping():
    """gluon_checks (shared by the Gluon prefill and GEMM): the architecture from the per-device cache, the check run
    once per key (None while it runs) and its outcome kept, the provenance text naming each outcome."""
    from rlkernel.backends.triton import gluon_checks as GC

    dev = torch.device("cuda", 0)
    assert GC.arch_reason(dev, {0: "sm_90"}) is None and GC.arch_reason(dev, {0: "sm_80"}) == "sm_80, not sm_90"
    cache, runs = {}, []

    def check():
        runs.append(dict(cache))  # what the kernel's own first call sees while its check runs
        return "first-use check: 2 values differ"

    assert GC.first_use(cache, (0, "t"), check) == "first-use check: 2 values differ"
    assert GC.first_use(cache, (0, "t"), check) == "first-use check: 2 values differ"
    assert runs == [{(0, "t"): None}]
    assert GC.first_use(cache, (0, "u"), lambda: None) is None and len(cache) == 2
    text = GC.describe_checks(cache, lambda k: k[1])
    assert text == "; first-use checks: cuda:0 t: first-use check: 2 values differ; cuda:0 u: bit-equal to Triton"
    assert GC.describe_checks({}, str) == ""


def test_descriptors_built_without_the_constructor_are_the_constructors():
    """gluon_checks.descriptor (gemm_gluon's and attention_gluon's launches) skips TensorDescriptor's __post_init__
    (host time a launch; scripts/bench_gluon_host.py):
    for every tile's operands it gives the object the constructor gives (the dataclass, field for field), and on a
    Triton whose TensorDescriptor has other fields it calls the constructor."""
    pytest.importorskip("triton.experimental.gluon")
    if GG._IMPORT_ERROR is not None:
        pytest.skip(GG._IMPORT_ERROR)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from rlkernel.backends.triton import gluon_checks as GC

    a = torch.zeros(300, 4096, dtype=torch.bfloat16)
    w = torch.zeros(6144, 4096, dtype=torch.bfloat16)[:, :4096]
    for tile in GG.TILES:
        for t, rows in ((a, tile.bm), (w, tile.bn1), (w, tile.bn2 or tile.bn1)):
            want = TensorDescriptor(t, [t.shape[0], 4096], [t.stride(0), 1], [rows, GG.BK], GG._layout(rows))
            got = GG._descriptor(t, t.shape[0], 4096, rows)
            assert type(got) is TensorDescriptor and got == want and got.base is t, (tile.name, got, want)
    assert GC._TD[1] is True  # Triton 3.6's fields: the constructor is skipped here
    saved, GC._TD[1] = GC._TD[1], False
    try:
        with pytest.raises(AssertionError, match="16-byte aligned"):  # the constructor (and its checks) again
            GG._descriptor(torch.zeros(8, 4097, dtype=torch.bfloat16), 8, 4097, 64)
    finally:
        GC._TD[1] = saved


def test_chain_gap_script_gap_kernel_counts_wall_time(tmp_path):
    """scripts/gpu_chain_gap.py's gap kernel spins on %globaltimer (wall time), not SM clocks (torch.cuda._sleep, whose
    calibration broke beside a power-capped GEMM in sessions 49-50): compiled for sm_90 here, its loop re-reads the
    global timer and no clock register; without CUDA the script writes its JSON with the reason and no rows."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    import gpu_chain_gap

    kernel = compile_sm90_or_skip(lambda: triton.compile(ASTSource(gpu_chain_gap.wall_sleep(), {"ns": "i64"}),
                                                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}))
    ptx = kernel.asm["ptx"]
    assert ptx.count("%globaltimer") == 2 and "bra" in ptx  # the start, and the re-read in the loop
    assert "%clock" not in ptx and "nanosleep" not in ptx
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(root / "scripts" / "gpu_chain_gap.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "chain_gap.json").read_text())
    assert res["rows"] == [] and "CUDA" in res["skipped"]

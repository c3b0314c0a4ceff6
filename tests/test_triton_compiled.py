"""What Triton's compiler makes of the strict GEMM for the H200 (sm_90), checked on a machine without a GPU: the kernels
are compiled for the target (Triton ships its own ptxas) and their Triton IR read.

Session 18 found on the H200 that the "registers" schedule of a k-segment linear gave other bits than the other
schedules wherever a K segment fits one K block (SmolLM2's o_proj: 576 / 4 = 144 <= block_k 256): the segment's loop
folds away and Triton's combine pass rewrites `s0 + dot(a, b, 0)` into `dot(a, b, s0)`, so the products accumulate
onto s0 inside the tensor-core chain instead of being rounded first. `gemm._kept` blocks that; here every segment's
dot must start from zero. The interpreter (the other Triton tests) never runs that pass, so only the compiled IR shows
it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from rlkernel.backends.triton import gemm  # noqa: E402
from helpers import compile_sm90_or_skip, wgmma_scale_d_not_always_on  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _compile(fn, signature: dict, constexprs: dict, asm: str = "ttir", **options) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    k = compile_sm90_or_skip(lambda: triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                                   options={"num_warps": 4, "num_stages": 3, **options}))
    return k.asm[asm]


def _dots(ttir: str) -> list[tuple[str, bool]]:
    """(the dot line, whether its accumulator operand is an all-zero constant) for every tt.dot."""
    zeros = set(re.findall(r"(%[\w.]+) = arith\.constant dense<0\.0+e\+00>", ttir))
    out = []
    for line in ttir.splitlines():
        m = re.search(r"= tt\.dot (%[\w.]+), (%[\w.]+), (%[\w.]+)", line)
        if m:
            out.append((line.strip(), m.group(3) in zeros))
    return out


@triton.jit
def _two_dots_probe(a_ptr, b_ptr, c_ptr, M, GUARD: tl.constexpr):
    r = tl.arange(0, 64)
    k = tl.arange(0, 16)
    n = tl.arange(0, 32)
    a0 = tl.load(a_ptr + r[:, None] * 32 + k[None, :])
    a1 = tl.load(a_ptr + r[:, None] * 32 + 16 + k[None, :])
    b0 = tl.load(b_ptr + k[:, None] * 32 + n[None, :])
    b1 = tl.load(b_ptr + (16 + k[:, None]) * 32 + n[None, :])
    s0 = tl.dot(a0, b0)
    s1 = tl.dot(a1, b1)
    if GUARD:
        s0 = gemm._kept(s0, M)
        s1 = gemm._kept(s1, M)
    tl.store(c_ptr + r[:, None] * 32 + n[None, :], s0 + s1)


@pytest.mark.parametrize("guard", [False, True])
def test_the_dot_add_combine_fires_on_a_bare_sum_and_not_behind_kept(guard):
    """The detector is live on this Triton: two dots from zero summed bare are combined into one chain (a dot whose
    accumulator is the other's result); behind `_kept` both start from zero."""
    ttir = _compile(_two_dots_probe, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "M": "i32"},
                    {"GUARD": guard})
    dots = _dots(ttir)
    assert len(dots) == 2
    if guard:
        assert all(z for _, z in dots), dots
    else:
        assert sum(not z for _, z in dots) == 1, dots


_SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "sam": "i32",
        "sak": "i32", "sbn": "i32", "sbk": "i32", "scm": "i32", "scn": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}


_SEGMENT_CASES = [("bf16", 2, 256, 144), ("bf16", 4, 256, 144), ("bf16", 8, 256, 144), ("bf16", 4, 64, 16),
                  ("fp32", 4, 32, 16)]


# the scratch walks' IR at 8 segments costs ~8 s of compiling each (CI's suite time): their loop is the same at every
# segment count (static_range), so 2 and 4 segments cover it; the registers schedule keeps all five cases
@pytest.mark.parametrize("schedule,dtype,segs,block_k,ks",
                         [("registers", *c) for c in _SEGMENT_CASES]
                         + [(s, *c) for s in ("scratch", "scratch_sliced") for c in _SEGMENT_CASES if c[1] != 8])
def test_every_k_segment_of_the_registers_schedule_starts_from_zero(schedule, dtype, segs, block_k, ks):
    """`_gemm_kernel`'s "registers" schedule (SEGS segments in one program, the tree in registers; "scratch": the same
    walk, waiting subtrees in global slots; "scratch_sliced": its merges by row slices from memory) where each segment
    is one K block (SmolLM2's o_proj, the toy's o/down; fp32 with 'ieee' dots too): one dot per segment, each from zero
    (no segment accumulates onto another's partial, nor onto a subtree loaded back). Fails without `_kept` (the
    combine chains pairs)."""
    sig = {k: (v.replace("bf16", dtype) if k in ("a_ptr", "b_ptr", "c_ptr") else v) for k, v in _SIG.items()}
    const = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=8, NUM_PROGS=132, TMA=False, B_NK=True,
                 IEEE=dtype == "fp32", SEGS=segs, SPLIT=False, K_FIXED=segs * ks, STREAM=False, FIXUP=False, BLOCK_N2=0,
                 SCRATCH=schedule.startswith("scratch"), SLOTS=segs.bit_length() - 1 + schedule.endswith("sliced"),
                 SLICED=schedule.endswith("sliced"))
    dots = _dots(_compile(gemm._gemm_kernel, sig, const, num_stages=2))
    assert len(dots) == segs, dots
    assert all(z for _, z in dots), [d for d, z in dots if not z]


@pytest.mark.parametrize("tma,block_m,block_n,block_n2,warps", [(True, 128, 64, 32, 8), (True, 64, 128, 64, 4),
                                                                (False, 128, 64, 32, 8)])
def test_a_two_accumulator_tile_lowers_to_wgmma_of_both_widths(tma, block_m, block_n, block_n2, warps):
    """A two-accumulator tile (TileConfig.block_n2: 96 = 64 + 32 or 192 = 128 + 64 columns) is two wgmma chains, one
    per accumulator width, each element's k16 steps in K order: the contract's bits, which hold for every wgmma tile
    (contracts/gpu.py). Lowered to mma.sync instead (another order) it would be another contract: checked on the PTX;
    every wgmma adds onto its accumulator (scale-d fixed true), which starts at +0 (the contract: "from +0.0")."""
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, NUM_PROGS=132, TMA=tma, B_NK=True,
                 IEEE=False, SEGS=1, SPLIT=False, K_FIXED=0, STREAM=False, FIXUP=False, BLOCK_N2=block_n2,
                 SCRATCH=False, SLOTS=0, SLICED=False)
    ptx = _compile(gemm._gemm_kernel, _SIG, const, asm="ptx", num_warps=warps)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx))
    assert shapes == {str(block_n), str(block_n2)}, shapes
    assert "mma.sync.aligned" not in ptx.replace("wgmma.mma_async.sync.aligned", "")
    assert not wgmma_scale_d_not_always_on(ptx)  # each chain from the zeroed accumulator, +0 (as the Gluon tiles)


_ATTN_ARGS = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "bt_ptr", "qs_ptr", "ql_ptr", "kl_ptr", "ks_ptr", "po_ptr", "pml_ptr",
              "lse_ptr", "sqt", "sqh", "sot", "soh", "skb", "skt", "skh", "sbt", "qk_scale", "n_tiles", "nseg", "kv_rows")
_ATTN_TYPES = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "bt_ptr": "*i32",
               "qs_ptr": "*i32", "ql_ptr": "*i32", "kl_ptr": "*i32", "ks_ptr": "*i32", "po_ptr": "*fp32",
               "pml_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}


@pytest.mark.parametrize("path", ["packed_tma", "packed_tma_split", "packed_tma_nested", "packed_pointer", "paged"])
def test_attention_compiles_for_sm90_with_wgmma_and_tma_where_packed(path):
    """The attention kernel for the H200 (Qwen3-8B heads: G = 4, D = 128, the contract's 64 x 64 tile): every path
    compiles (the interpreter accepts code the compiler refuses: session 25's first TMA build passed it and failed on
    the GPU), both dots lower to wgmma (m64, k16: the contract's order), and the packed prefill's K / V go through the
    bulk tensor copy (cp.async.bulk.tensor) exactly when asked, the paged cache's never."""
    from rlkernel.backends.triton import attention as A

    tma = path.startswith("packed_tma")
    const = dict(G=4, BLOCK_M=64, BLOCK_N=64, D=128, SEG_CHUNKS=8, PAGED=path == "paged", SPLIT=path.endswith("split"),
                 PAGE=16, IEEE=False, STORE_LSE=not path.endswith("split"), NESTED=path.endswith("nested"), TMA=tma)
    sig = {a: _ATTN_TYPES.get(a, "i32") for a in _ATTN_ARGS}
    ptx = _compile(A._attn_fwd, sig, const, asm="ptx", enable_fp_fusion=False)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx))
    assert shapes == {"64", "128"}, shapes  # q.k^T: 64 keys wide; p.v: D = 128 wide
    assert "mma.sync.aligned" not in ptx.replace("wgmma.mma_async.sync.aligned", "")
    assert ("cp.async.bulk.tensor" in ptx) == tma


def test_gluon_warp_specialisation_compiles_for_sm90():
    """scripts/gpu_gluon_ws.py's experiment (a producer warp of TMA loads, a wgmma consumer warpgroup) compiles for the
    H200 with this Triton: register reallocation between the partitions (setmaxnreg), TMA loads, wgmma — the Hopper
    warp specialisation that Triton's automatic pass does not emit (sessions 19-25). Its bits and speed are the GPU's
    to tell (`gpu_session.py gluon_ws`)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    pytest.importorskip("triton.experimental.gluon")
    import gpu_gluon_ws as G

    facts = G.ptx_facts(compile_sm90_or_skip(lambda: G.compile_sm90(*G.TILES[0])))
    assert facts["setmaxnreg"] and facts["tma_loads"] >= 2 and facts["wgmma"] > 0, facts
    assert facts["warps"] == G.TILES[0][4] + 4  # the consumer's warps + the producer's warp, rounded to a warpgroup


def _reduce_layouts(ttgir: str) -> set:
    """The layout definitions (not their aliases) of every tt.reduce's input in a TTGIR module, with the reduce's
    combine op: what decides a row reduction's order on the GPU."""
    defs = dict(re.findall(r"^(#\w+) = (.+)$", ttgir, flags=re.M))
    out = set()
    for m in re.finditer(r'"tt\.reduce"\(.*?\{axis = (\d+).*?\n\s+%\S+ = (arith\.\w+).*?\}\) : \(tensor<([^>]*?), (#\w+)>',
                         ttgir, flags=re.S):
        out.add((m.group(2), m.group(3), defs.get(m.group(4), m.group(4))))
    return out


def _float_ops(ttgir: str) -> set:
    return set(re.findall(r"= (math\.\w+|arith\.(?:maxnumf|minnumf|maximumf|minimumf|addf|subf|mulf|divf|truncf|cmpf))",
                          ttgir))


@pytest.mark.parametrize("variant", ["production", "two", "qreg", "qk_first", "qreg_qk_first", "diag_trace"])
def test_gluon_prefill_has_the_triton_kernels_arithmetic_for_sm90(variant):
    """attention_gluon's prefill (Gluon, warp-specialised) claims the bits of attention._attn_fwd: equal on the H200
    (session 27, `gpu_gluon_attn.py`), and here for any later edit — both kernels compiled for sm_90, their row
    reductions (max, sum) run on the same layout (NVMMA v3, 4 warps, instr 16 x 64 x 16, which fixes the order), they
    use the same kinds of float ops (maxnumf, never NaN-propagating maximumf; no contracted fma) and the same wgmma
    shapes; the Gluon kernel has its producer warp's register hand-over and TMA loads, and no spills. Also for the
    schedule knobs (session 33: the query tile from registers, q.k^T issued before p.v), which move no arithmetic, and
    for DIAG 4 (session 41: the %clock64 timeline, which adds the stamps and drops the lse store). "production" is
    the three-consumer kernel (attention_gluon3, session 42: the library's for long requests), "two" the two-consumer
    one, which the knobs vary.
    ptxas must not serialize the wgmmas (C7511: session 34's two-chunk q.k^T experiment met it)."""
    pytest.importorskip("triton.experimental.gluon")
    import sys
    from pathlib import Path

    from rlkernel.backends.triton import attention as A

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_gluon_attn as GA

    const = dict(G=4, BLOCK_M=64, BLOCK_N=64, D=128, SEG_CHUNKS=8, PAGED=False, SPLIT=False, PAGE=16, IEEE=False,
                 STORE_LSE=True, NESTED=False, TMA=True)
    sig = {a: _ATTN_TYPES.get(a, "i32") for a in _ATTN_ARGS}
    triton_ir = _compile(A._attn_fwd, sig, const, asm="ttgir", enable_fp_fusion=False)
    k = compile_sm90_or_skip(lambda: GA.compile_sm90(variant))
    gluon_ir = k.asm["ttgir"]
    mma64 = "#ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 64, 16]}>"
    want = {("arith.maxnumf", "64x64xf32", mma64), ("arith.addf", "64x64xf32", mma64)}
    assert _reduce_layouts(triton_ir) == want, _reduce_layouts(triton_ir)
    assert _reduce_layouts(gluon_ir) == want, _reduce_layouts(gluon_ir)
    lse_ops = {"math.log2"} if variant == "diag_trace" else set()  # DIAG 4 stores no lse
    assert _float_ops(gluon_ir) == _float_ops(triton_ir) - lse_ops, _float_ops(gluon_ir) ^ _float_ops(triton_ir)
    assert "arith.maximumf" not in _float_ops(gluon_ir)
    facts = GA.ptx_facts(k)
    assert facts["wgmma_shapes"] == ["m64n128k16", "m64n64k16"], facts
    assert facts["setmaxnreg"] and facts["tma_loads"] >= 2, facts
    assert "0 bytes spill stores" in facts["ptxas"] and "C7514" not in facts["ptxas"], facts["ptxas"]
    assert "C7511" not in facts["ptxas"], facts["ptxas"]
    # q.k^T's A operand: a register list with the query tile in registers, else a shared-memory descriptor
    a_ops = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16\s+\{[^}]*\},\s*(\S)",
                           k.asm["ptx"]))
    assert a_ops == ({"{"} if "qreg" in variant else {"%"}), a_ops


def test_gluon_prefill_picks_three_consumers_for_long_requests_only(monkeypatch):
    """attention_gluon.consumers_for: under auto (the default) the three-consumer kernel where the longest request has
    THREE_FROM query tokens or more (n_tiles x tokens a tile), else the two-consumer one; RLKERNEL_ATTENTION_CONSUMERS
    2 or 3 forces one, self_check's forcing wins over both; the three-consumer kernel refuses the other's knobs; a bad
    value of the variable is refused at import, naming it."""
    from rlkernel.backends.triton import attention_gluon as AG

    assert AG.CONSUMERS == 0 and AG.THREE_FROM == 1536  # the suite runs with the default
    assert AG.consumers_for(96, 16) == 3 and AG.consumers_for(95, 16) == 2 and AG.consumers_for(48, 32) == 3
    assert AG.consumers_for(1, 1) == 2
    monkeypatch.setattr(AG, "CONSUMERS", 2)
    assert AG.consumers_for(10_000, 16) == 2
    monkeypatch.setattr(AG, "CONSUMERS", 3)
    assert AG.consumers_for(1, 16) == 3
    monkeypatch.setattr(AG, "_FORCED", [2])
    assert AG.consumers_for(10_000, 16) == 2
    AG._three_knobs(AG.STAGES, 3, 0, AG.QREG, AG.QK_FIRST)  # diag 3 is the three-consumer kernel's own
    with pytest.raises(ValueError, match="qreg"):
        AG._three_knobs(AG.STAGES, 0, 0, 1, AG.QK_FIRST)
    with pytest.raises(ValueError, match="diag"):
        AG._three_knobs(AG.STAGES, 4, 0, AG.QREG, AG.QK_FIRST)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", "import rlkernel.backends.triton.attention_gluon"],
                          env={**env, "RLKERNEL_ATTENTION_CONSUMERS": "4", "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "RLKERNEL_ATTENTION_CONSUMERS='4': expected auto, 2 or 3" in proc.stderr, \
        proc.stderr[-2000:]


def test_gluon_prefill_layout_is_made_once_and_is_tritons_default():
    """attention_gluon.kv_layout keeps Triton's default shared layout per (block_n, d) instead of asking for it every
    launch: equal to a fresh `get_default_for` (so the descriptors' specialization string, and with it the compiled
    kernel, are the ones an uncached launch gets), one object per key, and keys kept apart."""
    pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon import language as gl

    from rlkernel.backends.triton import attention_gluon as AG

    for bn, d in ((64, 128), (128, 128), (64, 32)):
        lay = AG.kv_layout(bn, d)
        fresh = gl.NVMMASharedLayout.get_default_for([bn, d], gl.bfloat16)
        assert lay == fresh and repr(lay) == repr(fresh), (lay, fresh)
        assert AG.kv_layout(bn, d) is lay
    assert AG.kv_layout(64, 128) != AG.kv_layout(64, 32)  # 64-byte rows: a 64-byte swizzle


def test_gluon_prefill_is_chosen_only_where_it_was_measured():
    """attention_gluon.unsupported_reason: the Triton kernel serves everything but the measured case (the same bits
    either way); each refusal names its reason, before any device query."""
    import torch

    from rlkernel.backends.triton import attention_gluon as AG
    from rlkernel.backends.triton import contracts as C

    q, k = torch.zeros(8, 32, 128, dtype=torch.bfloat16), torch.zeros(8, 8, 128, dtype=torch.bfloat16)
    ok = dict(paged=False, split=False, tma=True, walk="flat")

    def why(q=q, k=k, cfg=C.ATTENTION, G=4, d=128, **kw):
        return AG.unsupported_reason(q, k, cfg, G, d, **{**ok, **kw})

    if AG._IMPORT_ERROR is not None:
        assert why().startswith("Gluon unavailable")
        return
    assert why(paged=True) == why(split=True) == why(walk="nested") == "paged, split or nested walk"
    assert why(tma=False) == "K / V not loadable through TMA"
    assert why(q=q.float(), k=k.float()) == "not bf16"
    assert why(d=64).startswith("not the measured shape") and why(G=3).startswith("not the measured shape")
    from dataclasses import replace
    assert why(cfg=replace(C.ATTENTION, block_n=128)).startswith("not the measured shape")
    AG._CHECKING.append(True)  # while the first-use check runs its reference: every call takes the Triton kernel
    try:
        assert why() == "first-use check running (its Triton side)"
    finally:
        AG._CHECKING.clear()
    with AG.off():
        assert why() == f"{AG.ENV}=0" and AG.describe() == f"off ({AG.ENV}=0)"
    assert AG.describe().startswith("on where supported")
    saved = dict(AG._CHECKED)
    AG._CHECKED.update({(0, 4): None, (0, 2): "first-use check: 3 values differ from the Triton kernel's"})
    try:  # provenance names each check's outcome
        assert AG.describe().endswith("first-use checks: cuda:0 G=2: first-use check: 3 values differ from the Triton "
                                      "kernel's; cuda:0 G=4: bit-equal to Triton")
    finally:
        AG._CHECKED.clear()
        AG._CHECKED.update(saved)
    import triton
    real = triton.__version__
    triton.__version__ = "9.9.0"
    try:
        assert why() == "Triton 9.9.0, checked with 3.6"
    finally:
        triton.__version__ = real

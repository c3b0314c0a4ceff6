"""The row-parallel GEMM's cluster tiles (rlkernel/backends/triton/gemm_cluster.py), checked without a GPU: the cga
layouts say which CTAs share which operand box (A along a cluster row, W along a cluster column, never a split of K),
the module names why it is unavailable under a Triton without Gluon's multicast, and — under a Triton that has it —
every tile compiles for sm_90 with the multicast loads and cross-CTA releases its claim rests on, no spills, no
serialised wgmma, and the same three tree adds as gemm_gluon's segmented tile. Bits and speed: the GPU's
(`scripts/gpu_gemm_cluster.py`)."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")
import triton  # noqa: E402

from rlkernel.backends.triton import gemm_cluster as GC  # noqa: E402


def _per_cta(box: list, bases: list) -> list:
    """The part of a [rows, cols] box one CTA holds: each non-zero basis halves the dimension it names."""
    out = list(box)
    for b in bases:
        for d, v in enumerate(b):
            if v:
                out[d] //= 2
    return out


@pytest.mark.parametrize("tile", list(GC.TILES.values()), ids=lambda t: t.name)
def test_the_cluster_layouts_share_boxes_not_k(tile):
    """One basis per CTA-id bit; each CTA's accumulator is the 128 x 128 tile, its A rows are its own 128 (shared
    with the CTAs of its cluster row), its W box the 128 columns of its cluster column; the K extent (BK) is never
    split. The barriers: `empty_w` is one per cluster column (the M bit shares), `empty_a` one per cluster row,
    `ready` one per CTA."""
    cg = GC.cga_layouts(tile.cm, tile.cn)
    bits = (tile.cm > 1) + (tile.cn > 1)
    assert all(len(cg[k]) == bits for k in cg)
    assert _per_cta([tile.bm * tile.cm, tile.bn * tile.cn], cg["acc"]) == [tile.bm, tile.bn]
    assert _per_cta([tile.bm * tile.cm, GC.BK], cg["a"]) == [tile.bm, GC.BK]
    assert _per_cta([tile.bn * tile.cn, GC.BK], cg["w"]) == [tile.bn, GC.BK]
    # which bits broadcast (a zero basis: CTAs differing only there hold the same box, loaded once and multicast)
    assert sum(b == [0, 0] for b in cg["a"]) == (tile.cn > 1) and sum(b == [0, 0] for b in cg["w"]) == (tile.cm > 1)
    assert GC._count(cg["empty_w"]) == tile.cn and GC._count(cg["empty_a"]) == tile.cm
    assert GC._count(cg["ready"]) == tile.ctas
    # the control: a layout that splits K (a [0, 1] basis on A) would halve BK per CTA
    assert _per_cta([256, GC.BK], [[0, 1]]) == [256, GC.BK // 2]


def test_unavailable_names_the_triton_it_needs():
    """Under a Triton older than 3.8 the module imports and says why; `launch` is never reached."""
    if GC._version(triton.__version__) >= GC.MIN_TRITON:
        assert GC.unavailable() in (None, f"{GC.ENV}=0")
    else:
        why = GC.unavailable()
        assert why is not None and "3.8" in why and triton.__version__ in why, why
    assert GC._version("3.10.0") > GC._version("3.8.0") > GC._version("3.6.0+git1a2b")


@pytest.mark.parametrize("name", ["seg4_c1x1", "seg4_c2x1", "seg4_c2x2", "seg4_c2x1_g", "seg4_c2x1_g6",
                                  "seg4_c2x1_gc", "seg4_c2x1_gr6", "seg4_c2x1_d", "seg4_c2x1_d6",
                                  "seg4_c2x1_dr6", "seg4_c2x1_d2s6"])
def test_every_cluster_tile_compiles_for_sm90_as_claimed(name):
    """m64n128k16 chains only; multicast loads exactly where a box is shared (W across the M pair, A across the N
    pair) and remote arrives only in a cluster (gsync: its mode's store / load pair instead, through `mapa` for the
    dsmem modes); no spills, no wgmma serialised for want of registers (ptxas C7512: Triton 3.9's code for this kernel
    had both, hence 3.8); the tree's three fp32 adds and nothing else on the accumulators; every wgmma adds onto its
    zeroed accumulator."""
    if GC.unavailable() is not None:
        pytest.skip(GC.unavailable())
    from helpers import compile_sm90_or_skip, ptxas_usage, wgmma_scale_d_not_always_on

    tile = GC.TILES[name]
    k = compile_sm90_or_skip(lambda: GC.compile_sm90(tile))
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)) == {"m64n128k16"}
    assert ptx.count("multicast::cluster") == (tile.cm > 1) + (tile.cn > 1)
    # cross-CTA releases: remote mbarrier arrives, or (gsync) the peer's release store and the lead's acquire spin
    assert ("arrive.shared::cluster" in ptx) == (tile.ctas > 1 and not tile.gsync)
    mode = GC.GSYNC_MODES[tile.sync]
    store, load = mode.store, mode.load
    space = ("shared::cluster", "shared::cta") if mode.shared else ("global", "global")
    assert (f"st.{store}.{space[0]}" in ptx and f"ld.{load}.{space[1]}" in ptx) == tile.gsync
    assert ("mapa.shared::cluster" in ptx) == tile.shared_counter
    assert (f".reqnctapercluster {tile.ctas}" in ptx) == (tile.ctas > 1)
    usage = ptxas_usage(ptx)
    assert "0 bytes spill stores" in usage and "C7512" not in usage, usage
    adds = len(re.findall(r"= arith\.addf %\S+, %\S+ : tensor<\d+x\d+xf32", ttgir))
    assert adds == 3, adds
    assert not re.search(r"= (arith\.mulf|math\.fma) .*tensor<\d+x\d+xf32", ttgir)
    assert not wgmma_scale_d_not_always_on(ptx)


def test_the_gpu_script_runs_here_and_records_why(tmp_path):
    """scripts/gpu_gemm_cluster.py --compile-only on a machine without a GPU: exit 0 and a JSON that names the
    Triton and, under one without multicast, why no tile was compiled (never a crash, never a silent empty record)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "scripts" / "gpu_gemm_cluster.py"), "--compile-only",
                           "--variants", "seg4_c1x1", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads((tmp_path / "gemm_cluster.json").read_text())
    assert rec["triton"] == triton.__version__
    if GC.unavailable() is None:
        assert rec["compiled_sm90"]["seg4_c1x1"].get("wgmma_shapes") == ["m64n128k16"], rec["compiled_sm90"]
    else:
        assert rec["gemm_cluster"] == GC.unavailable() and rec["compiled_sm90"] == {}


def test_a_tile_the_kernel_cannot_synchronise_is_refused():
    """gsync's counter names one peer (a 2 x 1 pair); clusters are 1 or 2 CTAs a side (the cga bases above)."""
    with pytest.raises(ValueError, match="2 x 1 cluster only"):
        GC.ClusterTile("bad", 2, 2, gsync=True)
    with pytest.raises(ValueError, match="1 or 2 CTAs a side"):
        GC.ClusterTile("bad", 4, 1)
    assert GC.ClusterTile("ok", 2, 1, gsync=True).ctas == 2


@pytest.mark.parametrize("sync", sorted(GC.GSYNC_MODES))
def test_each_gsync_block_names_its_semantics(sync):
    """The PTX block of each W-release mode (built from strings, so checked here under any Triton): the peer's store
    and the lead's load carry the mode's semantics and scope in the state space it claims (a global word, or the
    lead's shared counter reached through mapa), the lead's count is rounded up to what the peer publishes, and the
    step-0 zeroing compares against 1 - S."""
    block = GC.gsync_asm(sync, 6)
    mode = GC.GSYNC_MODES[sync]
    store, load = mode.store, mode.load
    if mode.shared:
        assert f"st.{store}.shared::cluster.b32 [ra], $2;" in block and "mapa.shared::cluster.u32 ra, a, 0;" in block
        assert f"ld.{load}.shared::cta.b32 v, [a];" in block and "setp.eq.s32 first, $2, -5;" in block
        every = 2 if sync.endswith(".2") else 1
        assert f"add.s32 r, $2, {every - 1};" in block and f"and.b32 r, r, {-every};" in block
        assert ".shared .align 1024" in block  # (16 bytes misaligned the TMA stages: session 44 call 6)
    else:
        assert f"st.{store}.global.b32 [$1], $2;" in block and f"ld.{load}.global.b32 v, [$1];" in block
    assert "{" not in block.replace("{\n", "", 1)  # every template field was filled


def test_cluster_tiles_refuse_what_their_handshake_cannot_do():
    with pytest.raises(ValueError, match="not one of"):
        GC.ClusterTile("x", 2, 1, gsync=True, sync="release.sys")
    with pytest.raises(ValueError, match="even number of stages"):
        GC.ClusterTile("x", 2, 1, stages=5, gsync=True, sync="dsmem.2")
    with pytest.raises(ValueError, match="2 x 1 cluster only"):
        GC.ClusterTile("x", 1, 2, gsync=True)
    assert GC.ClusterTile("x", 2, 1, stages=6, gsync=True, sync="dsmem.2").ctas == 2

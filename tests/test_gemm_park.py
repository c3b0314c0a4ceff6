"""The parked-partial segmented GEMM tiles (rlkernel/backends/triton/gemm_park.py), checked without a GPU: every tile
compiles for sm_90 within the shared memory a block may have, with no spills and no serialised wgmma, the segment
tree is exactly its fp32 adds, the hi partial goes through global memory only where the tile parks it (in 8-byte
vectors), the shared partial's layout is the swizzle the tile names, and bad input is refused before a launch. Bits
and speed are the GPU's to tell (`scripts/gpu_gemm_park.py`)."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from rlkernel.backends.triton import gemm_park as GP  # noqa: E402
from helpers import compile_sm90_or_skip, ptxas_usage, wgmma_scale_d_not_always_on  # noqa: E402


def _compiled(tile):
    if GP.unavailable() is not None:
        pytest.skip(GP.unavailable())
    return compile_sm90_or_skip(lambda: GP.compile_sm90(tile))


FLAT = GP.ParkTile("flat_128x256_k32s4", 128, 128, 128, 4, 4, 8, persistent=True, group_m=8, bk=32, swz=False)


@pytest.mark.parametrize("tile", list(GP.TILES.values()) + [FLAT], ids=lambda t: t.name)
def test_every_park_tile_compiles_for_sm90_as_claimed(tile):
    k = _compiled(tile)
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    widths = {int(w) for w in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16", ptx)}
    assert widths == {tile.bn1, tile.bn2}, widths
    # a K loop per segment, a k16 chain a step per accumulator
    assert ptx.count("wgmma.mma_async") == tile.segs * 2 * tile.bk // 16
    assert tile.shared_bytes <= k.metadata.shared <= GP.SHARED_LIMIT, (tile.shared_bytes, k.metadata.shared)
    usage = ptxas_usage(ptx)
    assert "0 bytes spill stores" in usage and "C7512" not in usage, usage
    # the tree, per accumulator: 4 segments (s0 + s1), (hi + s3) and lo + that; 2 segments s0 + s1; nothing else
    adds = len(re.findall(r"= arith\.addf %\S+, %\S+ : tensor<\d+x\d+xf32", ttgir))
    assert adds == {4: 6, 2: 2, 1: 0}[tile.segs], adds
    assert not re.search(r"= (arith\.mulf|math\.fma) .*tensor<\d+x\d+xf32", ttgir)
    assert not wgmma_scale_d_not_always_on(ptx)
    # hi through global memory only where parked: a thread's 64 + 64 (or 64 + 32) fp32, in 8-byte vectors
    per_thread = tile.bm * tile.bn // (tile.warps * 32)
    assert ptx.count("st.global.v2.b32") == ptx.count("ld.global.v2.b32") == (per_thread // 2 if tile.park else 0)
    assert "st.global.b32" not in ptx and "ld.global.b32" not in ptx
    if tile.segs == 1:  # nothing waits: no partial's buffer
        assert "swizzled_shared<{vec = 8" not in ttgir
        return
    vec, phase = (8, 8) if tile.swz else (1, 1)
    assert f"#ttg.swizzled_shared<{{vec = {vec}, perPhase = 1, maxPhase = {phase}, order = [1, 0]}}>" in ttgir


def test_park_tiles_refuse_what_they_do_not_build():
    for kw in ({"segs": 3}, {"segs": 8}, {"bn2": 0}, {"bk": 128}, {"park": 2}):
        args = dict(name="bad", bm=128, bn1=128, bn2=128, stages=2, segs=4, warps=8) | kw
        with pytest.raises(ValueError):
            GP.ParkTile(**args)
    tile = GP.TILES["seg4_128x256_k32s4"]
    a = torch.zeros(256, 4096, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="4 segments"):
        GP._check(a[:, :4000], torch.zeros(256, 4000, dtype=torch.bfloat16), tile)
    with pytest.raises(ValueError, match="2 segments of whole 32-column"):  # 4,080 = 2 x 2,040, not whole steps
        GP._check(a[:, :4080], torch.zeros(256, 4080, dtype=torch.bfloat16), GP.TILES["seg2_128x256_k32s4"])
    with pytest.raises(ValueError, match="bf16"):
        GP._check(a.float(), torch.zeros(256, 4096), tile)
    with pytest.raises(ValueError, match="bf16"):
        GP._check(a, torch.zeros(256, 2048, dtype=torch.bfloat16), tile)


def test_the_gpu_script_compiles_here_and_refuses_unknown_variants(tmp_path):
    """scripts/gpu_gemm_park.py --compile-only on a machine without a GPU: exit 0 and a JSON with the tile's facts
    (no rows: no GPU); an unknown variant is an argument error naming the known ones, before any compile."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if GP.unavailable() is not None:
        pytest.skip(GP.unavailable())
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "gpu_gemm_park.py")
    proc = subprocess.run([sys.executable, script, "--compile-only", "--variants", "seg4_128x256_k32s4", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads((tmp_path / "gemm_park.json").read_text())
    facts = rec["compiled_sm90"]["seg4_128x256_k32s4"]
    assert facts.get("wgmma_shapes") == ["m64n128k16"] and facts["ring_and_partial_bytes"] == 229376, facts
    assert "rows" not in rec
    bad = subprocess.run([sys.executable, script, "--compile-only", "--variants", "seg4_128x512", "--out",
                          str(tmp_path / "bad")], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "unknown variants ['seg4_128x512']" in bad.stderr and "seg4_128x256_k32s4" in bad.stderr
    assert not (tmp_path / "bad").exists()

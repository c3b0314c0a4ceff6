"""The strict GEMM's warp-specialised tiles on Hopper (sm_90), written in Gluon: the same bits as `gemm.matmul`,
scheduled as cuBLAS schedules the shapes where the Triton kernel falls short.

Same arithmetic: a tile's outputs accumulate in fp32 over K in order, 64 columns of K a step, each step one wgmma
k16 chain in order (A and W from shared memory, loaded through TMA), so every output element sees the products in the
contract's order whatever the tile's shape (the contract's tile-invariance: 24 Triton tiles gave equal bits on the
H200, sessions 10-12); bf16 out by one rounding. With K segments (the row-parallel layers' canonical segments) each
segment's chain starts from zero and the partials fold into the balanced tree ((s0 + s1) + (s2 + s3)) in fp32 as
they end: `ksegments`' order. A producer warp streams every step's loads into a ring of shared-memory stages; the
consumer warpgroups run the wgmma chains (one in flight) and the epilogue.

What the Triton kernel cannot express (Triton 3.6):
* **Tiles of 192 columns** (two accumulators, 128 + 64 columns, each its own wgmma chain over the same A stage): wave
  balance at small M. cuBLAS's kernels there are `nvjet_sm90_tst_96x128` / `192x128` (session 28,
  `scripts/gpu_cublas_probe.py`); N = 6,144 at M = 256 makes 4 x 32 = 128 tiles of 64 x 192 on 132 SMs, where the
  Triton table's 128 x 128 makes 96.
* **The segment tree in a warp-specialised consumer**: the loads never stop at a segment boundary (the Triton
  schedules restart their pipelined K loop per segment or keep partials in memory).
A tile may also run one program per SM walking its tiles in groups of M tiles (`persistent`, `group_m`): the next
tile's loads run under this one's epilogue, and at M = 16,384 the walk keeps A's rows in L2.

Measured on the H200 (chain timer, bits equal to `gemm.matmul` on every row; `scripts/gpu_gluon_gemm.py`, records in
benchmarks/h200_session28-29): qkv M = 256 64 x 192 (6 stages) 0.91-0.93x cuBLAS over 5 interleaved rounds (the
Triton kernel 0.68-0.69x; 128 x 96 0.79-0.82x); 128 x 192 (5 stages) qkv M = 512 / 1,024 0.86-0.90 / 0.88-0.96x,
gate_up M = 256 0.88-0.91x; 4 segments: o / down M = 256 64 x 128 0.95 / 0.88x (scratch 0.67 / 0.76x), from M = 512
128 x 128 persistent 0.84 / 0.87-0.91x, M = 1,024 0.79-0.82 / 0.85-0.88x, M = 4,096 0.86-0.87 / 0.90x, M = 16,384
0.89 / 0.92x (scratch 0.57-0.65 / 0.76-0.79x); lm_head M = 256 128 x 256 persistent 0.93x (the Triton table
0.86-0.88x). On an H100 (session 49, benchmarks/H100_session49; 7-9 interleaved rounds): 64 x 192 with 7 stages
0.903-0.914x at qkv M = 256 (6 stages 0.856-0.878x), 128 x 192 persistent 0.894-0.895x at gate_up M = 256 (one
program a tile 0.851-0.854x; that GEMM runs at the card's 700 W cap, where cuBLAS's 1 x 2-cluster kernel multicasts
W); a second step of wgmmas in flight and programmatic dependent launch lost everywhere (knobs `depth` / `pdl`, kept
for the record). Where the rule below does not pick a tile (M <= 128, other widths, more tiles than about two waves, K
below 4,096) the Triton kernel runs: nothing else was measured.

Used by `gemm.matmul` (a weight [N, K], the contract's tiles: config None, bf16 in and out, TMA-loadable operands)
where `pick` names a tile and `unsupported_reason` is None: sm_90, Triton 3.6, and a first-use check per device and
tile that this kernel and the Triton kernel give bit-equal outputs on a small GEMM (a difference keeps the Triton
kernel there, logged). `RLKERNEL_GEMM_GLUON=0` keeps the Triton kernel everywhere.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from .gluon_checks import arch_reason, compile_sm90 as _compile_sm90, describe_checks, descriptor, first_use, \
    gate_reason, switched_off
from .launch import fast

ENV = "RLKERNEL_GEMM_GLUON"
_ENABLED = os.environ.get(ENV, "1") != "0"
BK = 64
TESTED_TRITON = ("3.6",)  # Gluon is experimental: the Triton minor versions this kernel was bit-checked with
MIN_K = 4096  # the shortest K measured (the 8B widths); shorter K keeps the Triton kernel
SEGMENTS = (4,)  # the segment counts measured (the canonical 4)
PRODUCER_REGS = 40
# Programmatic dependent launch (a launch attribute; the kernel's griddepcontrol.wait blocks until the kernel before it
# in the stream has finished and its writes are visible): the launch, the barriers' set-up and (2) the weight's first
# stages overlap the previous kernel's tail. 2 loads W before the wait, so it is only for weights that the kernel just
# before does not write. Both lost on an H100 (session 49, scripts/gpu_gluon_gemm.py): no library tile takes them.
PDL_MODES = {0: "off", 1: "every load after the wait", 2: "the first stages of W before the wait (experiment)"}
# An L2 prefetch of W ahead of the operand ring (experiment, no library tile): every PREFETCH_STEPS K steps one lane of
# the producer warp asks L2 for the tile's W rows x the next PREFETCH_STEPS x BK columns, `prefetch` steps ahead of its
# TMA loads (a hint: no register, no shared memory, no bit). Below the power cap gate_up at M = 256 streams W ~9 %
# slower than cuBLAS (benchmarks/H100_session50/CALLS.md, call 14). Session 50's version issued one 512-byte
# cp.async.bulk.prefetch.L2 a W row (192 requests a round) and ran 1.6-2.2x slower on an H100 (session 51, call 3: the
# cost grew with the rounds, not the distance, so the requests themselves); this one issues one
# cp.async.bulk.prefetch.tensor a round through its own tensor map (`prefetch_map`: box rows x PREFETCH_STEPS x BK).
PREFETCH_STEPS = 4

try:  # Gluon ships with Triton >= 3.5 as `triton.experimental.gluon`; its API is young, so any failure is a reason
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    from .ksegments import _tree4  # @triton.jit functions: Gluon inlines them
    from .tile import _tile_coords
    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class Tile:
    name: str
    bm: int
    bn1: int
    bn2: int  # a second accumulator's columns (0: none)
    stages: int
    segs: int
    warps: int  # the consumer warpgroups' warps (the default partition)
    persistent: bool = False  # one program per SM walking the tiles (else one program per tile)
    group_m: int = 0  # the tile walk: 0 = M tiles fastest; g = groups of g M tiles (L2 locality; never a bit)
    depth: int = 1  # K steps of wgmma in flight behind the one issued (a stage is freed `depth` steps later; no bit)
    pdl: int = 0  # programmatic dependent launch (PDL_MODES); 2 needs K >= stages x BK (its first-tile prologue)
    prefetch: int = 0  # K steps ahead of the producer's loads that W is prefetched into L2 (0: none; no bit)

    def __post_init__(self):  # (gemm_park.ParkTile, which builds those, validates itself)
        if self.depth < 1 or (self.depth > 1 and self.segs > 1):
            raise ValueError(f"{self.name}: depth {self.depth}: 1, or more on an unsegmented tile")
        if self.pdl not in PDL_MODES:
            raise ValueError(f"{self.name}: pdl {self.pdl} is not one of {sorted(PDL_MODES)}")
        if self.prefetch < 0 or self.prefetch % PREFETCH_STEPS or (self.prefetch and self.bn > 256):
            raise ValueError(f"{self.name}: prefetch {self.prefetch}: 0 or a multiple of {PREFETCH_STEPS} K steps, "
                             "over a tile of at most 256 W rows (a tensor map's box)")
        if self.segs > 1 and self.bn2:
            raise ValueError(f"{self.name}: segments over two accumulators need the tree's partials parked outside "
                             "the registers: gemm_park.ParkTile (this kernel folds one accumulator's segments)")

    @property
    def bn(self) -> int:
        return self.bn1 + self.bn2


# session 49 (an H100, 7 interleaved rounds): 7 stages over 6 at qkv M = 256 0.903 / 0.856x cuBLAS (the H200 in
# session 29: 0.935 / 0.925x); the two-wave tile persistent at gate_up M = 256 0.895 / 0.854x, qkv M = 1,024 0.865 /
# 0.854x (benchmarks/H100_session49)
ONE_WAVE = Tile("64x192_s7", 64, 128, 64, 7, 1, 4)  # the tile where one wave covers the GEMM (session 28: 128 x 96)
TWO_WAVES = Tile("128x192_s5_p", 128, 128, 64, 5, 1, 8, persistent=True, group_m=8)
SEG_64x128 = Tile("seg4_64x128", 64, 128, 0, 6, 4, 4)
SEG_128x128 = Tile("seg4_128x128_p", 128, 128, 0, 4, 4, 8, persistent=True, group_m=8)
VOCAB = Tile("128x256_p", 128, 128, 128, 4, 1, 8, persistent=True, group_m=8)  # vocabulary-wide N at small M
VOCAB_MIN_N = 65536
TILES = (ONE_WAVE, TWO_WAVES, SEG_64x128, SEG_128x128, VOCAB)


def pick(m: int, n: int, k: int, segments: int, sms: int) -> Tile | None:
    """The tile for an [m, k] x [n, k]^T GEMM with `segments` canonical K segments on a GPU of `sms` SMs, or None
    (the Triton kernel). Sessions 28-29's measurements (module docstring) and nothing beyond them:
    - no segments: 64 x 192 (7 stages since session 49; 6 before) where its tiles fit one wave (qkv at M = 256:
      4 x 32 = 128 tiles on 132 SMs), else 128 x 192 (5 stages; persistent since session 49, one program per SM
      walking the tiles) where its tiles fit two waves (qkv M = 512 / 1,024: 128 / 256; gate_up M = 256: 256);
      above that (M = 4,096, gate_up M >= 512) the Triton table's tiles were as fast or faster. A vocabulary-wide N
      (>= 65,536: lm_head's 151,936, no 192-column tile divides it) up to 256 rows: 128 x 256 persistent in groups of
      8 M tiles (session 29 call 5, lm_head M = 256: 0.93x cuBLAS, the Triton table 0.86-0.88x, 128 x 192 s5
      persistent 0.91x; at M = 1,024 the Triton table's 1.03x beat every Gluon tile's 0.83-0.93x). Session 29 call 2
      (3 interleaved rounds, medians of per-round ratios to cuBLAS): qkv M = 256 64 x 192 s6 0.89x, 128 x 96 s5 / s6 /
      s7 / s8 0.79 / 0.79 / 0.79 / 0.80x (call 1: s4 0.71, s5 0.82, s6 0.87: within the calls' spread), 64 x 192 s5
      0.83x; 128 x 192 s5 / s4: qkv M = 512 0.86 / 0.82x, 1,024 0.96 / 0.94x, gate_up M = 256 0.88 / 0.86x;
    - 4 segments from m = 129: 64 x 128 up to 256 rows, above it 128 x 128 with one program per SM walking the tiles
      in groups of 8 M tiles (session 29 call 1: o / down M = 512 0.80 / 0.82x, 1,024 0.82 / 0.79x, 4,096 0.81 /
      0.90x, 16,384 0.88 / 0.92x cuBLAS, against one program a tile walking M tiles fastest 0.81 / 0.80, 0.75 / 0.73,
      0.80 / 0.88, 0.66 / 0.68x: at 16,384 rows A alone outgrows L2 in that walk). M <= 128 keeps fixup / registers,
      which beat the scratch schedule there and were not raced against this kernel.
    """
    if m <= 128 or k < MIN_K:
        return None
    if segments == 1:
        if n % ONE_WAVE.bn == 0 and -(-m // ONE_WAVE.bm) * (n // ONE_WAVE.bn) <= sms:
            return ONE_WAVE
        if n % TWO_WAVES.bn == 0 and -(-m // TWO_WAVES.bm) * (n // TWO_WAVES.bn) <= 2 * sms:
            return TWO_WAVES
        if n >= VOCAB_MIN_N and m <= 256:
            return VOCAB
        return None
    if segments not in SEGMENTS or k % (BK * segments) or n % 128:
        return None
    return SEG_64x128 if m <= 256 else SEG_128x128


if _IMPORT_ERROR is None:
    _PRODUCER_WARPS = gl.constexpr(1)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
    _PREFETCH_STEPS = gl.constexpr(PREFETCH_STEPS)

    @gluon.jit
    def _origin(t, num_pid_m, num_pid_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
        """Tile t's first row and column: GROUP_M 0 walks M tiles fastest (a 2-D grid's order), else groups of
        GROUP_M M tiles across every N tile (the Triton kernels' walk, tile._tile_coords). The walk decides which
        tiles share L2, never a bit."""
        if GROUP_M == 0:
            pm = t % num_pid_m
            pn = t // num_pid_m
        else:
            pm, pn = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
        return pm * BM, pn * BN

    @gluon.jit
    def _gdc_wait():
        """griddepcontrol.wait: until the grids this one depends on (programmatic dependent launch) have completed
        and their memory is visible; at once where the launch had no such dependency."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gdc_launch_dependents():
        """griddepcontrol.launch_dependents: the next kernel (if launched with PDL) may be scheduled now."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_w(pf_map, off_n, k0):
        """Lane 0 of the calling warp: one cp.async.bulk.prefetch.tensor of `pf_map`'s box (W rows off_n.., columns
        k0..; TMA drops what lies outside W) into L2. pf_map: the global address of the tensor map
        (`prefetch_map`)."""
        gl.inline_asm_elementwise(
            "{ .reg .pred pfp; .reg .b32 pfl; mov.u32 pfl, %laneid; setp.eq.u32 pfp, pfl, 0; "
            "@pfp cp.async.bulk.prefetch.tensor.2d.L2.global.tile [$1, {$2, $3}]; } // $0",
            "=r,l,r,r", [pf_map, k0, off_n], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _tensormap_acquire(pf_map):
        """fence.proxy.tensormap::generic.acquire of the 128-byte tensor map at pf_map: the map was written through the
        generic proxy (a copy from the host), TMA reads it through the tensormap proxy."""
        gl.inline_asm_elementwise("fence.proxy.tensormap::generic.acquire.gpu [$1], 128; // $0", "=r,l", [pf_map],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _producer(a_desc, w1_desc, w2_desc, bufs_a, bufs_w1, bufs_w2, ready, empty, num_pid_m, num_pid_n, k_steps,
                  step, BM: gl.constexpr, BK: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr,
                  GROUP_M: gl.constexpr, PDL: gl.constexpr = 0, pf_map=None, PREFETCH: gl.constexpr = 0):
        """One warp: every step of this program's tiles (A box, W boxes of BN1 rows then BN2) into stage g % S (g:
        the program's step count over its tiles) once the consumer freed it. PDL (PDL_MODES): 1 waits before the
        first load; 2 loads the first tile's first S steps of W, waits, then their A (k_steps >= S). PREFETCH > 0:
        each PREFETCH_STEPS steps, the tile's W rows x the next PREFETCH_STEPS steps' columns, PREFETCH steps ahead,
        into L2 (one request through pf_map)."""
        S: gl.constexpr = bufs_a.type.shape[0]
        if BN2 > 0:
            nbytes: gl.constexpr = a_desc.block_type.nbytes + w1_desc.block_type.nbytes + w2_desc.block_type.nbytes
        else:
            nbytes: gl.constexpr = a_desc.block_type.nbytes + w1_desc.block_type.nbytes
        first = 0
        if PDL == 2:
            off_m, off_n = _origin(gl.program_id(0), num_pid_m, num_pid_n, BM, BN1 + BN2, GROUP_M)
            for j in gl.static_range(S):  # fresh stages: nothing to wait for
                mbarrier.expect(ready.index(j), nbytes)
                tma.async_copy_global_to_shared(w1_desc, [off_n, j * BK], ready.index(j), bufs_w1.index(j))
                if BN2 > 0:
                    tma.async_copy_global_to_shared(w2_desc, [off_n + BN1, j * BK], ready.index(j), bufs_w2.index(j))
            _gdc_wait()
            for j in gl.static_range(S):
                tma.async_copy_global_to_shared(a_desc, [off_m, j * BK], ready.index(j), bufs_a.index(j))
            first = S
        elif PDL == 1:
            _gdc_wait()
        if PREFETCH > 0:
            _tensormap_acquire(pf_map)
        g = 0
        for t in range(gl.program_id(0), num_pid_m * num_pid_n, step):
            off_m, off_n = _origin(t, num_pid_m, num_pid_n, BM, BN1 + BN2, GROUP_M)
            for i in range(first, k_steps):
                gi = g + i
                s = gi % S
                if PREFETCH > 0:  # (a constexpr: default tiles compile without it)
                    if (i % _PREFETCH_STEPS == 0) & (i + PREFETCH < k_steps):
                        _prefetch_w(pf_map, off_n, (i + PREFETCH) * BK)
                mbarrier.wait(empty.index(s), ((gi // S) & 1) ^ 1)  # a fresh barrier counts as released once
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], ready.index(s), bufs_a.index(s))
                tma.async_copy_global_to_shared(w1_desc, [off_n, i * BK], ready.index(s), bufs_w1.index(s))
                if BN2 > 0:
                    tma.async_copy_global_to_shared(w2_desc, [off_n + BN1, i * BK], ready.index(s), bufs_w2.index(s))
            g += k_steps
            first = 0

    @gluon.jit
    def _store(c_ptr, acc, off_m, col0, M, N, stride_cm, BM: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        gl.store(c_ptr + rows[:, None].to(gl.int64) * stride_cm + cols[None, :], acc.to(gl.bfloat16),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    @gluon.jit
    def _k_step(bufs_a, bufs_w1, bufs_w2, ready, empty, gi, release, acc, acc2, BN2: gl.constexpr,
                DEPTH: gl.constexpr = 1):
        """K step gi: wait for its stage, its wgmma onto acc (and acc2 where BN2 > 0; else acc2 comes back as given),
        then at most DEPTH steps' wgmmas in flight (this one's included), so step gi - DEPTH's stage is released (where
        `release`). Wgmmas onto one accumulator run in issue order, so DEPTH moves no arithmetic."""
        S: gl.constexpr = bufs_a.type.shape[0]
        s = gi % S
        mbarrier.wait(ready.index(s), (gi // S) & 1)
        acc = warpgroup_mma(bufs_a.index(s), bufs_w1.index(s).permute((1, 0)), acc, is_async=True)
        if BN2 > 0:
            acc2 = warpgroup_mma(bufs_a.index(s), bufs_w2.index(s).permute((1, 0)), acc2, is_async=True)
            acc, acc2 = warpgroup_mma_wait(num_outstanding=2 * DEPTH, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=DEPTH, deps=(acc,))
        mbarrier.arrive(empty.index((gi + S - DEPTH) % S), count=1, pred=release)  # step gi - DEPTH is free
        return acc, acc2

    @gluon.jit
    def _consumer(bufs_a, bufs_w1, bufs_w2, ready, empty, num_pid_m, num_pid_n, k_steps, step, c_ptr, M, N, stride_cm,
                  BM: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr, SEGS: gl.constexpr, GROUP_M: gl.constexpr,
                  l1: gl.constexpr, l2: gl.constexpr, DEPTH: gl.constexpr = 1, PDL: gl.constexpr = 0):
        """Per tile of this program: acc (+ acc2) += A_k @ W_k^T, one wgmma chain per accumulator, K in order, one
        step in flight; SEGS > 1: each of SEGS equal K segments from zero, folded into the balanced tree as it ends.
        (Issuing a segment's first wgmma before the previous segment's fold, session 29: ptxas serialises the wgmmas
        and spills 512 bytes at 64 x 128 and 128 x 128 — so does peeling a segment's first step without the overlap;
        and nothing to win: the same tile unsegmented, with no drains at all, ran no faster (call 2). Not kept.)
        DEPTH (unsegmented): steps in flight (`_k_step`). PDL: the next kernel may be scheduled at once, and nothing is
        stored before the kernel this one depends on has finished."""
        S: gl.constexpr = bufs_a.type.shape[0]
        if PDL > 0:
            _gdc_launch_dependents()
            _gdc_wait()
        seg_steps = k_steps // SEGS
        g = 0
        for t in range(gl.program_id(0), num_pid_m * num_pid_n, step):
            off_m, off_n = _origin(t, num_pid_m, num_pid_n, BM, BN1 + BN2, GROUP_M)
            if SEGS > 1:
                lo = gl.zeros((BM, BN1), gl.float32, l1)
                hi = lo
                for sg in gl.static_range(SEGS):
                    acc = gl.zeros((BM, BN1), gl.float32, l1)
                    for j in range(seg_steps):
                        i = sg * seg_steps + j
                        acc, _ = _k_step(bufs_a, bufs_w1, bufs_w2, ready, empty, g + i, i > 0, acc, acc, BN2)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    lo, hi = _tree4(lo, hi, acc, sg)  # segment sg ended: into the tree
                _store(c_ptr, lo, off_m, off_n, M, N, stride_cm, BM, BN1, l1)
            else:
                acc = gl.zeros((BM, BN1), gl.float32, l1)
                if BN2 > 0:
                    acc2 = gl.zeros((BM, BN2), gl.float32, l2)
                else:
                    acc2 = acc  # (unused)
                for i in range(k_steps):
                    acc, acc2 = _k_step(bufs_a, bufs_w1, bufs_w2, ready, empty, g + i, i >= DEPTH, acc, acc2, BN2,
                                        DEPTH)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _store(c_ptr, acc, off_m, off_n, M, N, stride_cm, BM, BN1, l1)
                if BN2 > 0:
                    acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2,))
                    _store(c_ptr, acc2, off_m, off_n + BN1, M, N, stride_cm, BM, BN2, l2)
            for d in gl.static_range(DEPTH):  # the tile's last DEPTH steps are free
                mbarrier.arrive(empty.index((g + k_steps + S - 1 - d) % S), count=1)
            g += k_steps

    @gluon.jit
    def _ring(STAGES: gl.constexpr):
        """The operand ring's `ready` (the producer's loads landed) and `empty` (the consumer freed the stage)
        mbarriers, one of each a stage, each completing on one arrival (gemm_park's kernel shares it)."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        return ready, empty

    @gluon.jit
    def _gemm_kernel(a_desc, w1_desc, w2_desc, c_ptr, M, N, K, stride_cm, step, BM: gl.constexpr,
                     BN1: gl.constexpr, BN2: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                     SEGS: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr, DEPTH: gl.constexpr = 1,
                     PDL: gl.constexpr = 0, pf_map=None, PREFETCH: gl.constexpr = 0):
        """C = A [M, K] @ W [N, K]^T in tiles of [BM, BN1 + BN2]: program p takes tiles p, p + step, ... in the walk
        `_origin` names (step = the tile count: one tile a program; = the grid: persistent). pf_map (W's prefetch
        tensor map, `prefetch_map`): only with PREFETCH."""
        l1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN1, 16])
        l2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN2 if BN2 > 0 else 8, 16])  # (unused at BN2 0)
        bufs_a = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        bufs_w1 = gl.allocate_shared_memory(w1_desc.dtype, [STAGES] + w1_desc.block_type.shape, w1_desc.layout)
        if BN2 > 0:
            bufs_w2 = gl.allocate_shared_memory(w2_desc.dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
        else:
            bufs_w2 = bufs_w1
        ready, empty = _ring(STAGES)
        k_steps = gl.cdiv(K, BK)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN1 + BN2)  # a last partial N tile: TMA fills zeros past N, the store masks
        gl.warp_specialize([
            (_consumer, (bufs_a, bufs_w1, bufs_w2, ready, empty, num_pid_m, num_pid_n, k_steps, step, c_ptr, M, N,
                         stride_cm, BM, BN1, BN2, SEGS, GROUP_M, l1, l2, DEPTH, PDL)),
            (_producer, (a_desc, w1_desc, w2_desc, bufs_a, bufs_w1, bufs_w2, ready, empty, num_pid_m, num_pid_n,
                         k_steps, step, BM, BK, BN1, BN2, GROUP_M, PDL, pf_map, PREFETCH)),
        ], [_PRODUCER_WARPS], [_PRODUCER_REGS])

    _gemm_fast = fast(_gemm_kernel)  # launch.py's fast path: Triton's own run at a key's first call, then its kernel


_LAYOUTS: dict = {}  # (rows, bk) -> the NVMMA shared layout of a [rows, bk] bf16 box
_ARCH: dict = {}  # device index -> its architecture (golden.gpu_arch), asked once
_SMS: dict = {}  # device index -> SM count
_CHECKED: dict = {}  # (device index, tile name) -> None (bit-equal to the Triton kernel) or why this tile is off there
_CHECKING: list = []  # non-empty while a first-use check runs its Triton side
_LAUNCHES = [0]  # this kernel's launches in this process


def off():
    """Within: the strict GEMM runs the Triton kernel everywhere in this process (as RLKERNEL_GEMM_GLUON=0 does) —
    the reference side of the benchmarks and tests that compare the two."""
    return switched_off(sys.modules[__name__])


def _layout(rows: int, bk: int = BK):
    """The NVMMA shared layout of a [rows, bk] bf16 box (gemm_park's kernel takes 32-column steps too)."""
    lay = _LAYOUTS.get((rows, bk))
    if lay is None:
        lay = _LAYOUTS[(rows, bk)] = gl.NVMMASharedLayout.get_default_for([rows, bk], gl.bfloat16)
    return lay


def _desc_sig(rows: int, bk: int = BK) -> str:
    """The signature type of a [rows, bk] bf16 box's descriptor (compile_sm90)."""
    return f"tensordesc<bf16[{rows}, {bk}],{_layout(rows, bk)!r}>"


def _aligned(t) -> bool:
    """TMA's rules for a 2-D bf16 operand: last dim contiguous, 16-byte aligned base and row stride."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def choose(a, w, segments: int, out_dtype, out) -> Tile | None:
    """The tile gemm.matmul runs here for a [M, K] @ w [N, K]^T, or None (the Triton kernel runs; `reason` says why
    when asked). Cheap tests first: this runs on every strict linear."""
    if not a.is_cuda:
        return None
    M, K = a.shape
    tile = pick(M, w.shape[0], K, segments, _sms(a.device))
    if tile is None or unsupported_reason(a, w, tile, out_dtype, out) is not None:
        return None
    return tile


def _sms(device) -> int:
    dev = device.index if device.index is not None else -1
    sms = _SMS.get(dev)
    if sms is None:
        import torch

        sms = _SMS[dev] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms


def unsupported_reason(a, w, tile: Tile, out_dtype=None, out=None) -> str | None:
    """None where this kernel serves the call with `tile`, else why the Triton kernel does (the same bits either
    way). The first call per device and tile runs `self_check` first: a bit that differs turns the tile off there."""
    why = gate_reason(_ENABLED, ENV, _IMPORT_ERROR, TESTED_TRITON, _CHECKING)
    if why is not None:
        return why
    if str(a.dtype) != "torch.bfloat16" or w.dtype != a.dtype or (out_dtype is not None and out_dtype != a.dtype):
        return "not bf16 in and out"
    if not (_aligned(a) and _aligned(w)) or (out is not None and (out.stride(-1) != 1 or out.dtype != a.dtype)):
        return "operands not loadable through TMA"
    why = arch_reason(a.device, _ARCH)
    if why is not None:
        return why
    dev = a.device.index if a.device.index is not None else -1
    return first_use(_CHECKED, (dev, tile.name), lambda: self_check(a.device, tile))


ZERO_ROW, ZERO_COL = 7, 5  # the first-use check's all -0 product chain


def self_check(device, tile: Tile) -> str | None:
    """At first use of `tile` on a device: a GEMM of 300 rows, K = 4,096, three tiles' columns less 40 (partial tiles
    in M and in N; bf16, fixed seed) through this kernel — launched as in production and again with two programs
    walking all of them (9 or 15 tiles: the persistent walk's step counter and stage phases across tiles) — and
    through the Triton kernel (gemm.matmul with the same segments); None when all three are bit-equal and the one
    output whose products are all -0 (a zero row against a negative column) is +0, else the reason this tile stays
    off (logged once). ~1 ms after the compiles."""
    import logging

    import torch

    from . import gemm

    gen = torch.Generator(device="cpu").manual_seed(28)
    M, K, N = 300, MIN_K, 3 * tile.bn - 40  # a partial M tile and a partial N tile
    a = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    a[ZERO_ROW] = 0.0  # against a column of negatives: every product -0; the contract's chain from +0.0 gives +0
    w[ZERO_COL] = -w[ZERO_COL].abs() - 1e-3  # (a chain begun without its zeroed accumulator would give -0)
    a, w = a.to(device=device, dtype=torch.bfloat16), w.to(device=device, dtype=torch.bfloat16)
    try:
        y = launch(a, w, tile)
        y2 = launch(a, w, tile, programs=2)
        _CHECKING.append(True)
        try:
            ref = gemm.matmul(a, w, k_segments=tile.segs, schedule="scratch" if tile.segs > 1 else None)
        finally:
            _CHECKING.clear()
    except Exception as e:  # noqa: BLE001 -- a kernel that cannot run here is a reason, never a crash
        why = f"first-use check failed to run: {type(e).__name__}: {str(e)[:200]}"
    else:
        n = int((y.view(torch.int16) != ref.view(torch.int16)).sum())  # bit patterns
        n2 = int((y2.view(torch.int16) != ref.view(torch.int16)).sum())
        zero = int(y.view(torch.int16)[ZERO_ROW, ZERO_COL])
        why = (None if n == n2 == 0 == zero else f"first-use check: {n} of {y.numel()} values differ from the Triton "
               f"kernel's ({n2} with two programs walking the tiles); a chain of -0 products gave bits {zero:#06x} "
               "(the contract: +0, 0x0000)")
    if why is not None:
        logging.getLogger(__name__).warning("rlkernel: the Gluon GEMM tile %s is off on %s: %s", tile.name, device, why)
    return why


def _descriptor(t, rows: int, cols: int, block_rows: int, bk: int = BK):
    """TensorDescriptor(t, [rows, cols], [t.stride(0), 1], [block_rows, bk], its layout) for a 2-D bf16 operand that
    `choose` found loadable through TMA (`_aligned`), without the constructor's checks (gluon_checks.descriptor)."""
    return descriptor(t, [rows, cols], [t.stride(0), 1], [block_rows, bk], _layout(block_rows, bk))


# cuTensorMapEncodeTiled's enums (cuda.h): bf16, no interleave, no swizzle, L2 promotion to 256 B, no NaN fill
_TMAP_BF16, _TMAP_L2_256B = 9, 3
_PREFETCH_MAPS: dict = {}  # (W's address, shape, stride, box rows, device) -> the map's 128 bytes on that device


def prefetch_map_bytes(w, rows: int, encode=None) -> bytes:
    """The 128-byte CUtensorMap over W [N, K] (bf16, rows of stride w.stride(0)) with a box of `rows` rows x
    PREFETCH_STEPS x BK columns, no swizzle (a prefetch only names bytes): cuTensorMapEncodeTiled through ctypes from
    libcuda (`encode`: that function, for a test). Refuses what a tensor map cannot describe."""
    import ctypes

    N, K = w.shape
    if w.dtype.itemsize != 2 or w.stride(1) != 1 or (w.stride(0) * 2) % 16 or w.data_ptr() % 16 or not 0 < rows <= 256:
        raise ValueError(f"the L2 prefetch's tensor map needs W as 2-byte rows of unit column stride, a row stride of "
                         f"16 bytes' multiple, 16-byte aligned, a box of 1-256 rows (W {tuple(w.shape)} "
                         f"{w.dtype}, strides {tuple(w.stride())}, rows {rows})")
    if encode is None:
        encode = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    raw = (ctypes.c_uint8 * 192)()  # CUtensorMap: 128 bytes at a 64-byte aligned address inside this buffer
    at = ctypes.addressof(raw) + (-ctypes.addressof(raw)) % 64
    u64x2, u32x2 = ctypes.c_uint64 * 2, ctypes.c_uint32 * 2
    rc = encode(ctypes.c_void_p(at), ctypes.c_int(_TMAP_BF16), ctypes.c_uint32(2), ctypes.c_void_p(w.data_ptr()),
                u64x2(K, N), (ctypes.c_uint64 * 1)(w.stride(0) * 2), u32x2(PREFETCH_STEPS * BK, rows), u32x2(1, 1),
                ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(_TMAP_L2_256B), ctypes.c_int(0))
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled returned CUresult {rc} for the L2 prefetch's map of W "
                           f"{tuple(w.shape)} (box {rows} x {PREFETCH_STEPS * BK})")
    return ctypes.string_at(at, 128)


def prefetch_map(w, rows: int, encode=None):
    """W's prefetch tensor map (`prefetch_map_bytes`) as a 128-byte uint8 tensor on W's device (the kernel reads it by
    its global address), cached per (address, shape, row stride, rows, device) — all a map holds, so a tensor later
    at the same address gets the same map. An experiment's cache, at most 64 maps; build it before a CUDA graph's
    capture (a copy to the device)."""
    import torch

    key = (w.data_ptr(), tuple(w.shape), w.stride(0), rows, str(w.device))
    m = _PREFETCH_MAPS.get(key)
    if m is None:
        if len(_PREFETCH_MAPS) >= 64:
            _PREFETCH_MAPS.clear()
        m = torch.frombuffer(bytearray(prefetch_map_bytes(w, rows, encode)), dtype=torch.uint8).to(w.device)
        _PREFETCH_MAPS[key] = m
    return m


def _launch_args(a, w, tile: Tile, out, programs: int | None = None):
    """(grid, args, kwargs) of one launch of `tile` for a [M, K] @ w [N, K]^T into out; `programs` (the first-use
    check) sets how many programs walk the tiles."""
    M, K = a.shape
    N = w.shape[0]
    if tile.pdl == 2 and K < tile.stages * BK:
        raise ValueError(f"{tile.name}: pdl 2 loads the first {tile.stages} K steps ahead; K = {K} has fewer")
    n2 = tile.bn2 or tile.bn1
    a_desc = _descriptor(a, M, K, tile.bm)
    w1 = _descriptor(w, N, K, tile.bn1)
    w2 = w1 if n2 == tile.bn1 else _descriptor(w, N, K, n2)
    tiles = -(-M // tile.bm) * -(-N // tile.bn)
    grid = programs or (min(tiles, _sms(a.device)) if tile.persistent else tiles)
    knobs = _knobs(tile)
    if tile.prefetch:
        knobs["pf_map"] = prefetch_map(w, tile.bn)
    return ((grid,), (a_desc, w1, w2, out, M, N, K, out.stride(0), grid),
            dict(BM=tile.bm, BN1=tile.bn1, BN2=tile.bn2, BK=BK, STAGES=tile.stages, SEGS=tile.segs,
                 GROUP_M=tile.group_m, num_warps=tile.warps, **knobs))


def _knobs(tile: Tile) -> dict:
    """The constexprs and launch option of `depth` / `pdl` / `prefetch`, passed only where they are not the kernel's
    defaults: a default tile launches with the arguments it had before the knobs (its PTX is unchanged but for line
    numbers). (`prefetch` also passes W's prefetch tensor map as pf_map: `_launch_args`.)"""
    k = {}
    if tile.depth != 1:
        k["DEPTH"] = tile.depth
    if tile.pdl:
        k["PDL"] = tile.pdl
        k["launch_pdl"] = True
    if tile.prefetch:
        k["PREFETCH"] = tile.prefetch
    return k


def launch(a, w, tile: Tile, out=None, programs: int | None = None):
    """a [M, K] @ w [N, K]^T -> out [M, N] bf16 through `tile` (call it where `choose` returned the tile), through
    launch.py's fast path (the compiled kernel Triton's own launch would run, less host time: session 28 measured the
    harness's do_bench at M = 256 host-bound on Triton's own launch of this kernel)."""
    import torch

    if out is None:
        out = torch.empty((a.shape[0], w.shape[0]), device=a.device, dtype=a.dtype)
    grid, args, kwargs = _launch_args(a, w, tile, out, programs)
    _LAUNCHES[0] += 1
    _gemm_fast[grid](*args, **kwargs)
    return out


def verify(a, w, tile: Tile, out):
    """`launch`'s arguments through launch.py's `FastKernel.verify` (the fast path runs Triton's own pick)."""
    grid, args, kwargs = _launch_args(a, w, tile, out)
    return _gemm_fast.verify(grid, *args, **kwargs)


def compile_sm90(tile: Tile):
    """`tile`'s kernel compiled for sm_90 here, with no GPU (Triton ships ptxas): the CompiledKernel (tests,
    scripts/gpu_gluon_gemm.py --compile-only)."""
    sig = {"a_desc": _desc_sig(tile.bm), "w1_desc": _desc_sig(tile.bn1), "w2_desc": _desc_sig(tile.bn2 or tile.bn1),
           "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32", "step": "i32"}
    const = {"BM": tile.bm, "BN1": tile.bn1, "BN2": tile.bn2, "BK": BK, "STAGES": tile.stages, "SEGS": tile.segs,
             "GROUP_M": tile.group_m, "num_warps": tile.warps}
    const.update(DEPTH=tile.depth, PDL=tile.pdl, PREFETCH=tile.prefetch)  # (an ASTSource takes no defaults)
    if tile.prefetch:
        sig["pf_map"] = "*u8"
    else:
        const["pf_map"] = None
    return _compile_sm90(_gemm_kernel, sig, const, num_warps=tile.warps, launch_pdl=bool(tile.pdl))


def describe() -> str:
    """For provenance: whether the strict GEMM may take these tiles in this process, and the first-use checks so far."""
    if not _ENABLED:
        return f"off ({ENV}=0)"
    if _IMPORT_ERROR is not None:
        return f"unavailable ({_IMPORT_ERROR})"
    return (f"on where picked (sm_90, bf16, K >= {MIN_K:,}; " + ", ".join(t.name for t in TILES) + ")"
            + describe_checks(_CHECKED, lambda k: k[1]))

"""The strict GEMM's row-parallel tile (4 canonical K segments) on Hopper (sm_90) at 128 x 256 — wider than the
128 x 128 that caps `gemm_gluon`'s segmented tile — by parking the segment tree's waiting partials outside the
registers: the same bits as `gemm.matmul(..., k_segments=4)`.

Why: the tree ((s0 + s1) + (s2 + s3)) keeps up to three fp32 partials live (lo = s0 + s1, hi = s2, and s3 as it
accumulates). At 128 x 256 (two consumer warpgroups, m64n256 each as two m64n128 chains) one partial is 128
registers a thread, so only the running accumulator stays in registers:
* lo waits in shared memory (128 KB fp32): s0 is stored there, s1's end reads it back and stores s0 + s1;
* hi (s2) waits in a per-program slot in global memory (`park` 1: 128 KB a program, resident in L2 — 132 programs
  are ~17 MB), read back at s3's end: lo + (hi + s3). `park` 0 keeps hi in registers (only where two partials fit:
  the 128 x 192 tile, session 32's seg4_128x192_p).
With 128 KB of partials, the operand ring gets ~96 KB: 2 stages of 64-column K steps or 4 of 32 (a K step of 32 is
two wgmma k16 where 64 is four: the same k16 chain in the same order, so the same bits). The swizzled fp32 layout
(`swz`) stores a consumer's NVMMA fragment without bank conflicts (8 rows x 32 bytes a warp store; the flat layout
session 32 used puts the 8 rows of a warp store in one bank group: 8-way conflicts).

Same arithmetic as gemm_gluon's consumer: each output accumulates in fp32 over K in order, one wgmma k16 chain a
segment from zero; the partials fold by `ksegments`' tree. Where a partial waits — registers, shared memory, L2 —
moves no bit.

**Status: an experiment that lost; `gemm.matmul` does not use it.** `scripts/gpu_gemm_park.py` checks its bits and
times it against cuBLAS and the library's seg4_128x128_p. Session 46 (an H100,
`benchmarks/H100_session46/call1`): every tile was bit-equal to the strict GEMM, with three programs and run to run.
Every tile was also slower than seg4_128x128_p in every row. The best, seg4_128x256_k32s4, ran o 0.72-0.74x and
down 0.82-0.86x cuBLAS at M >= 4,096, against 0.86-0.88x and 0.89-0.90x. The same ring without the parking
(`plain_128x256_k32s4`, 0.91x) puts the parking's cost at 23 % of a tile at o (K = 4,096) and 11 % at down (K = 12,288).
hi's L2 slot alone costs ~14 % at o (128 x 192: `_k32s6_pk` 0.670x against `_k32s6_swz` 0.778x): all 132 programs
reach a boundary together and wait on L2.
"""
from __future__ import annotations

from dataclasses import dataclass

from .gemm_gluon import PRODUCER_REGS, Tile, _IMPORT_ERROR, _desc_sig, _descriptor, _sms

try:
    if _IMPORT_ERROR is not None:
        raise ImportError(_IMPORT_ERROR)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait

    from .gemm_gluon import _k_step, _origin, _producer, _ring, _store
    _PARK_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001
    _PARK_IMPORT_ERROR = f"{type(e).__name__}: {e}"

SHARED_LIMIT = 232448  # sm_90's shared memory a block may opt into (227 KB)


@dataclass(frozen=True)
class ParkTile(Tile):
    bk: int = 64  # K columns a pipeline step (32 or 64: the same wgmma k16 chain)
    park: int = 1  # 1: hi (s2) waits in a global slot; 0: in registers
    swz: bool = True  # the shared partial's layout: swizzled (else flat, session 32's)

    def __post_init__(self):  # (not Tile's: this kernel builds segments over two accumulators)
        if self.segs not in (1, 2, 4) or not self.bn2 or self.bk not in (32, 64) or self.park not in (0, 1):
            raise ValueError(f"{self.name}: 4 or 2 segments (1: the diagnostic), two accumulators, bk 32 or 64 and "
                             "park 0 or 1, got "
                             f"{self.segs}, bn2 {self.bn2}, bk {self.bk}, park {self.park}")

    @property
    def shared_bytes(self) -> int:
        """The ring's stages and the waiting partial (barriers aside; segs 1 waits for nothing)."""
        return self.stages * (self.bm + self.bn) * self.bk * 2 + (self.bm * self.bn * 4 if self.segs > 1 else 0)


def _t(name, bn2, stages, bk, park=1, swz=True):
    return ParkTile(name, 128, 128, bn2, stages, 4, 8, persistent=True, group_m=8, bk=bk, park=park, swz=swz)


TILES = {t.name: t for t in (
    _t("seg4_128x256_k64s2", 128, 2, 64), _t("seg4_128x256_k32s4", 128, 4, 32), _t("seg4_128x256_k32s3", 128, 3, 32),
    # 128 x 192: hi fits in registers beside the accumulator (two pairs of 96 registers). For o / down a layout A/B
    # only (192 does not divide N = 4,096: session 32's loss), against seg4_128x192_p below: the swizzle, and a deeper
    # ring of 32-column steps
    _t("seg4_128x192_k64s3_swz", 64, 3, 64, park=0), _t("seg4_128x192_k32s6_swz", 64, 6, 32, park=0),
    _t("seg4_128x192_k32s6_pk", 64, 6, 32, park=1),
    # the diagnostic: one chain over K (no segments, nothing parked; the unsegmented bits) with the same ring (one
    # program per SM either way, so the shared memory it does not hold changes no occupancy): what the parking costs
    # is its time against seg4_128x256_k32s4's
    ParkTile("plain_128x256_k32s4", 128, 128, 128, 4, 1, 8, persistent=True, group_m=8, bk=32, park=0),
    # 2 canonical segments (rlkernel.row_segments=2: TP 1 or 2): the tree is s0 + s1, so only s0 waits, in shared
    # memory, and nothing goes to L2. Its time against plain_128x256_k32s4 is the shared-memory partial's cost alone
    ParkTile("seg2_128x256_k32s4", 128, 128, 128, 4, 2, 8, persistent=True, group_m=8, bk=32, park=0),
    # session 32's two-accumulator segmented tiles (gemm_gluon's kernel until session 45): hi in registers, lo in the
    # flat layout, 3 stages of 64-column steps; o / down 0.44-0.74x there (seg4_128x128_p 0.79-0.94x): 192 and 160 do
    # not divide N = 4,096 (22 / 26 N tiles, the last part empty), and the flat layout's 8-way bank conflicts
    _t("seg4_128x192_p", 64, 3, 64, park=0, swz=False), _t("seg4_128x160_p", 32, 3, 64, park=0, swz=False))}


def unavailable() -> str | None:
    return _PARK_IMPORT_ERROR


if _PARK_IMPORT_ERROR is None:
    _PRODUCER_WARPS = gl.constexpr(1)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.jit
    def _consumer_park(bufs_a, bufs_w1, bufs_w2, lo_smem, lo2_smem, ready, empty, num_pid_m, num_pid_n, k_steps, step,
                       c_ptr, park_ptr, M, N, stride_cm, BM: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr,
                       GROUP_M: gl.constexpr, SEGS: gl.constexpr, PARK: gl.constexpr, l1: gl.constexpr,
                       l2: gl.constexpr):
        """Per tile: 4 segments, each (acc, acc2) from zero over its K steps; s0 into lo_smem, s1's end lo_smem +=,
        s2 waits (PARK 1: in this program's global slot, else in registers), s3's end: lo + (hi + s3), stored.
        2 segments: s0 into lo_smem, s1's end: s0 + s1, stored."""
        S: gl.constexpr = bufs_a.type.shape[0]
        BN: gl.constexpr = BN1 + BN2
        seg_steps = k_steps // SEGS
        slot = park_ptr + gl.program_id(0) * (BM * BN)
        r1 = gl.arange(0, BM, layout=gl.SliceLayout(1, l1))
        c1 = gl.arange(0, BN1, layout=gl.SliceLayout(0, l1))
        r2 = gl.arange(0, BM, layout=gl.SliceLayout(1, l2))
        c2 = gl.arange(0, BN2, layout=gl.SliceLayout(0, l2))
        p1 = slot + r1[:, None] * BN + c1[None, :]
        p2 = slot + r2[:, None] * BN + (BN1 + c2)[None, :]
        g = 0
        for t in range(gl.program_id(0), num_pid_m * num_pid_n, step):
            off_m, off_n = _origin(t, num_pid_m, num_pid_n, BM, BN, GROUP_M)
            for sg in gl.static_range(SEGS):
                acc = gl.zeros((BM, BN1), gl.float32, l1)
                acc2 = gl.zeros((BM, BN2), gl.float32, l2)
                for j in range(seg_steps):
                    i = sg * seg_steps + j
                    acc, acc2 = _k_step(bufs_a, bufs_w1, bufs_w2, ready, empty, g + i, i > 0, acc, acc2, BN2)
                acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
                if SEGS == 1:
                    lo = acc
                    lo2 = acc2
                elif sg == 0:
                    lo_smem.store(acc)
                    lo2_smem.store(acc2)
                elif SEGS == 2:
                    lo = lo_smem.load(l1) + acc
                    lo2 = lo2_smem.load(l2) + acc2
                elif sg == 1:
                    lo_smem.store(lo_smem.load(l1) + acc)
                    lo2_smem.store(lo2_smem.load(l2) + acc2)
                elif sg == 2:
                    if PARK == 1:
                        gl.store(p1, acc)
                        gl.store(p2, acc2)
                    else:
                        hi = acc
                        hi2 = acc2
                else:
                    if PARK == 1:
                        lo = lo_smem.load(l1) + (gl.load(p1) + acc)
                        lo2 = lo2_smem.load(l2) + (gl.load(p2) + acc2)
                    else:
                        lo = lo_smem.load(l1) + (hi + acc)
                        lo2 = lo2_smem.load(l2) + (hi2 + acc2)
            _store(c_ptr, lo, off_m, off_n, M, N, stride_cm, BM, BN1, l1)
            _store(c_ptr, lo2, off_m, off_n + BN1, M, N, stride_cm, BM, BN2, l2)
            mbarrier.arrive(empty.index((g + k_steps + S - 1) % S), count=1)  # the tile's last step is free
            g += k_steps

    @gluon.jit
    def _park_kernel(a_desc, w1_desc, w2_desc, c_ptr, park_ptr, M, N, K, stride_cm, step, BM: gl.constexpr,
                     BN1: gl.constexpr, BN2: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                     SEGS: gl.constexpr, GROUP_M: gl.constexpr, PARK: gl.constexpr, SWZ: gl.constexpr,
                     num_warps: gl.constexpr):
        l1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN1, 16])
        l2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN2, 16])
        bufs_a = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        bufs_w1 = gl.allocate_shared_memory(w1_desc.dtype, [STAGES] + w1_desc.block_type.shape, w1_desc.layout)
        bufs_w2 = gl.allocate_shared_memory(w2_desc.dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
        if SWZ:  # 8 fp32 (32 bytes) a vector, the vector index XOR the row mod 8: a warp's 8 rows in 8 bank groups
            lay: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        else:
            lay: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        lo_smem = gl.allocate_shared_memory(gl.float32, [BM, BN1], lay)
        lo2_smem = gl.allocate_shared_memory(gl.float32, [BM, BN2], lay)
        ready, empty = _ring(STAGES)
        k_steps = gl.cdiv(K, BK)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN1 + BN2)
        gl.warp_specialize([
            (_consumer_park, (bufs_a, bufs_w1, bufs_w2, lo_smem, lo2_smem, ready, empty, num_pid_m, num_pid_n, k_steps,
                              step, c_ptr, park_ptr, M, N, stride_cm, BM, BN1, BN2, GROUP_M, SEGS, PARK, l1, l2)),
            (_producer, (a_desc, w1_desc, w2_desc, bufs_a, bufs_w1, bufs_w2, ready, empty, num_pid_m, num_pid_n,
                         k_steps, step, BM, BK, BN1, BN2, GROUP_M)),
        ], [_PRODUCER_WARPS], [_PRODUCER_REGS])


_SLOTS: dict = {}  # (device index, elements) -> the programs' fp32 slots


def _check(a, w, tile: ParkTile) -> None:
    if _PARK_IMPORT_ERROR is not None:
        raise RuntimeError(f"gemm_park unavailable: {_PARK_IMPORT_ERROR}")
    M, K = a.shape
    if a.dtype != w.dtype or str(a.dtype) != "torch.bfloat16" or w.shape[1] != K:
        raise ValueError(f"{tile.name}: bf16 [M, K] @ [N, K]^T, got {tuple(a.shape)} {a.dtype} and "
                         f"{tuple(w.shape)} {w.dtype}")
    if K % (tile.segs * tile.bk):
        raise ValueError(f"{tile.name}: K = {K} is not {tile.segs} segments of whole {tile.bk}-column steps")


def launch(a, w, tile: ParkTile, out=None, programs: int | None = None):
    """a [M, K] @ w [N, K]^T -> out [M, N] bf16 with `tile.segs` canonical K segments through `tile`; `programs`
    sets how many programs walk the tiles (default: one per SM, at most one per tile)."""
    import torch

    _check(a, w, tile)
    M, K = a.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty((M, N), device=a.device, dtype=a.dtype)
    tiles = -(-M // tile.bm) * -(-N // tile.bn)
    grid = programs or min(tiles, _sms(a.device))
    key = (a.device.index, grid * tile.bm * tile.bn)
    slots = _SLOTS.get(key)
    if slots is None:
        slots = _SLOTS[key] = torch.empty(key[1], device=a.device, dtype=torch.float32)
    bk = tile.bk
    _park_kernel[(grid,)](_descriptor(a, M, K, tile.bm, bk), _descriptor(w, N, K, tile.bn1, bk),
                          _descriptor(w, N, K, tile.bn2, bk), out, slots, M, N, K,
                          out.stride(0), grid, BM=tile.bm, BN1=tile.bn1, BN2=tile.bn2, BK=tile.bk, STAGES=tile.stages,
                          SEGS=tile.segs, GROUP_M=tile.group_m, PARK=tile.park, SWZ=tile.swz, num_warps=tile.warps)
    return out


def compile_sm90(tile: ParkTile):
    """`tile`'s kernel compiled for sm_90 here, with no GPU (Triton ships ptxas)."""
    if _PARK_IMPORT_ERROR is not None:
        raise RuntimeError(f"gemm_park unavailable: {_PARK_IMPORT_ERROR}")
    from .gluon_checks import compile_sm90 as _compile_sm90

    bk = tile.bk
    sig = {"a_desc": _desc_sig(tile.bm, bk), "w1_desc": _desc_sig(tile.bn1, bk), "w2_desc": _desc_sig(tile.bn2, bk),
           "c_ptr": "*bf16", "park_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32",
           "step": "i32"}
    const = {"BM": tile.bm, "BN1": tile.bn1, "BN2": tile.bn2, "BK": bk, "STAGES": tile.stages, "SEGS": tile.segs,
             "GROUP_M": tile.group_m, "PARK": tile.park, "SWZ": tile.swz, "num_warps": tile.warps}
    # c_ptr and park_ptr 16-byte aligned, as a launch specialises them (torch's allocations): vector stores
    attrs = {(3,): [["tt.divisibility", 16]], (4,): [["tt.divisibility", 16]]}
    return _compile_sm90(_park_kernel, sig, const, attrs, num_warps=tile.warps)

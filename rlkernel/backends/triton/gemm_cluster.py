"""The strict GEMM's row-parallel tile (4 canonical K segments) on Hopper (sm_90) as a cluster of CTAs that share
operand tiles through TMA multicast: the same bits as `gemm.matmul` and `gemm_gluon`'s `seg4_128x128_p`, with fewer
bytes from L2 into each SM. Needs Triton >= 3.8 (Gluon's multicast TMA and cross-CTA mbarriers); with an older
Triton this module imports and reports why it is unavailable.

Why: the segment tree ((s0 + s1) + (s2 + s3)) keeps three fp32 partials live, which caps one CTA's tile at 128 x 128
(at 128 x 256 three accumulators need 384 registers a thread). A 128 x 128 tile reads 32 KB of operands a 64-deep
K step for 2.1 MFLOP; cuBLAS's 256 x 128 tile in a 1 x 2 cluster reads ~40 KB for 4.2 MFLOP (session 33's ncu: the
128 x 128 tile moves ~1.6x cuBLAS's L2 bytes and keeps the tensor pipe 74 % busy against cuBLAS's 95 %). Here a
cluster of CM x CN CTAs, each still a 128 x 128 tile with its own three partials, covers a [128 CM, 128 CN] tile:
the W box of a cluster column is loaded once and multicast to the CM CTAs that use it, the A box of a cluster row
to the CN CTAs that use it. Per SM and K step: (128 / CN + 128 / CM) x 64 x 2 bytes (1 x 1: 32 KB, 2 x 1: 24 KB,
2 x 2: 16 KB).

Same arithmetic as gemm_gluon's consumer: each CTA's outputs accumulate in fp32 over K in order, 64 columns of K a
step, each step one wgmma k16 chain (m64n128 per warpgroup, two warpgroups a CTA); each segment's chain from zero,
folded into the tree as it ends (`ksegments._tree4`). Which CTA loads a box, and into whose shared memory, never
changes a product or its order.

Synchronisation: every CTA waits on its own `ready` barrier of a stage (its A rows and the W box, whoever loaded
them). A box that is multicast is issued by its group's lead CTA (Gluon's lowering), which may overwrite a stage only
once every CTA of the group has released it: `empty_w` (shared by the CTAs of a cluster column) and `empty_a` (shared
by the CTAs of a cluster row) gather every consumer's release on the group's lead, and only the lead waits. `gsync`
tiles (2 x 1 only) use no cross-CTA barrier: the peer's producer, once its own consumers released a stage, publishes
the released-step count to a counter, and the lead's producer spins on it before loading W into both CTAs (one inline
PTX block; a Gluon scalar atomic would be broadcast through the cluster with the barriers that fault). The counter is
a global word of the cluster, or (`dsmem` modes) a word of the lead's shared memory the peer stores into through
`mapa`; `GSYNC_MODES` names each mode's semantics and scope.

**Status (sessions 43-44): an experiment, not used by `gemm.matmul`.** Measured on H100s under Triton 3.8.0 staged
beside torch 2.11 (`benchmarks/H100_session43/CALLS.md`, `benchmarks/H100_session44/CALLS.md`): the 1 x 1 tile is
bit-equal to the strict GEMM and runs as the library's seg4_128x128_p; every tile using Triton 3.8's cross-CTA
mbarriers (2 x 1, 1 x 2) failed at launch ("unspecified launch failure"; a 2-CTA probe isolates the cross-CTA
barrier, while a multicast TMA copy alone is bit-exact). The gsync pairs run and are bit-equal (every row, run to run,
three clusters), and do not win: the global counter 0.23-0.36x cuBLAS whatever its scope or fences (one global
load's round trip a K step), the shared counter with release / acquire (`dsmem`) 0.47-0.58x, and with relaxed
accesses (`seg4_c2x1_dr6`) o 0.833 against the library tile's 0.838x (M = 4,096, one round), down 0.798 against
0.846x (M = 4,096, two rounds). Sharing W's box across the pair cuts the bytes into each SM by a quarter and buys
nothing: those bytes are not what caps the 128 x 128 tile. Triton 3.9's code for this kernel
spills 768 bytes and serialises its wgmmas (ptxas C7512), hence 3.8.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

ENV = "RLKERNEL_GEMM_CLUSTER"
_ENABLED = os.environ.get(ENV, "1") != "0"
BK = 64
MIN_TRITON = (3, 8)
PRODUCER_REGS = 40
# sync -> (the peer's store, the lead's load): release / acquire at GPU or cluster scope (both CTAs share a cluster),
# or relaxed at cluster scope (no fence: the peer's consumers read the stage through wgmma, complete before their
# release, so no read of it is left to order: an argument from completion, not a PTX memory-model guarantee)
# "dsmem": the counter lives in the lead's shared memory (a .shared variable of the asm block: Gluon gives no shared
# address to inline PTX), the peer stores into it through `mapa` (release, cluster scope) and the lead polls its own
# (acquire); the block runs from step 0, where the lead zeroes it (before its first W load, which every peer store
# follows)
class GsyncMode(NamedTuple):
    store: str  # the peer's store: semantics.scope
    load: str  # the lead's load
    shared: bool = False  # the counter in the lead's shared memory (dsmem), else a global word
    every: int = 1  # the peer publishes every `every`-th count


GSYNC_MODES = {"release.gpu": GsyncMode("release.gpu", "acquire.gpu"),
               "release.cluster": GsyncMode("release.cluster", "acquire.cluster"),
               "relaxed.cluster": GsyncMode("relaxed.cluster", "relaxed.cluster"),
               "dsmem": GsyncMode("release.cluster", "acquire.cluster", shared=True),
               "dsmem.relaxed": GsyncMode("relaxed.cluster", "relaxed.cluster", shared=True),
               "dsmem.2": GsyncMode("release.cluster", "acquire.cluster", shared=True, every=2)}


def _version(v: str) -> tuple:
    """(major, minor) of a version string ("3.6.0+git1a2b" -> (3, 6))."""
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


try:
    import triton

    if _version(triton.__version__) < MIN_TRITON:
        raise ImportError(f"Triton {triton.__version__}: TMA multicast and cross-CTA mbarriers need Gluon in Triton "
                          f">= {'.'.join(map(str, MIN_TRITON))}")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    from .gemm_gluon import _k_step, _origin, _store
    from .ksegments import _tree4
    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class ClusterTile:
    name: str
    cm: int  # CTAs of a cluster along M (they share W's box)
    cn: int  # CTAs of a cluster along N (they share A's box)
    stages: int = 4
    segs: int = 4
    bm: int = 128  # one CTA's tile
    bn: int = 128
    warps: int = 8  # one CTA's consumer warps (two warpgroups of 64 rows)
    group_m: int = 8
    gsync: bool = False  # the W group's stage release through a counter, not a cross-CTA mbarrier (cm = 2, cn = 1)
    sync: str = "release.gpu"  # gsync's store / load semantics and scope (GSYNC_MODES)

    def __post_init__(self):
        if self.cm not in (1, 2) or self.cn not in (1, 2):
            raise ValueError(f"{self.name}: clusters of 1 or 2 CTAs a side, got {self.cm} x {self.cn}")
        if self.gsync and (self.cm, self.cn) != (2, 1):
            raise ValueError(f"{self.name}: the global-counter release (gsync) serves a 2 x 1 cluster only")
        if self.sync not in GSYNC_MODES:
            raise ValueError(f"{self.name}: sync {self.sync!r} is not one of {sorted(GSYNC_MODES)}")
        # every CTA's step count (k_steps, a multiple of segs) is even: with S even, the last count the lead waits
        # for, rounded up to even, is one the peer publishes
        if GSYNC_MODES[self.sync].every == 2 and self.stages % 2:
            raise ValueError(f"{self.name}: publishing every other count needs an even number of stages")

    @property
    def shared_counter(self) -> bool:
        """gsync through the lead's shared memory (no global counter to zero at launch)."""
        return self.gsync and GSYNC_MODES[self.sync].shared

    @property
    def ctas(self) -> int:
        return self.cm * self.cn


TILES = {t.name: t for t in (ClusterTile("seg4_c1x1", 1, 1), ClusterTile("seg4_c2x1", 2, 1),
                             ClusterTile("seg4_c1x2", 1, 2), ClusterTile("seg4_c2x2", 2, 2),
                             ClusterTile("seg4_c2x1_g", 2, 1, gsync=True),
                             ClusterTile("seg4_c2x1_g6", 2, 1, stages=6, gsync=True),
                             ClusterTile("seg4_c2x1_gc", 2, 1, gsync=True, sync="release.cluster"),
                             ClusterTile("seg4_c2x1_gc6", 2, 1, stages=6, gsync=True, sync="release.cluster"),
                             ClusterTile("seg4_c2x1_gr6", 2, 1, stages=6, gsync=True, sync="relaxed.cluster"),
                             ClusterTile("seg4_c2x1_d", 2, 1, gsync=True, sync="dsmem"),
                             ClusterTile("seg4_c2x1_d6", 2, 1, stages=6, gsync=True, sync="dsmem"),
                             ClusterTile("seg4_c2x1_dr6", 2, 1, stages=6, gsync=True, sync="dsmem.relaxed"),
                             ClusterTile("seg4_c2x1_d2s6", 2, 1, stages=6, gsync=True, sync="dsmem.2"))}


def _bases(cm: int, cn: int):
    """The cluster's CTA-id bits: the first (if cm = 2) splits M, the next (if cn = 2) splits N."""
    bits = []
    if cm == 2:
        bits.append("m")
    if cn == 2:
        bits.append("n")
    return bits


def cga_layouts(cm: int, cn: int) -> dict:
    """The cga layouts (bases over the CTA-id bits) of the accumulator [BM cm, BN cn], the A box [BM cm, BK] (the
    same CTA-id bit along N broadcasts: multicast), the W box [BN cn, BK] (the M bit broadcasts), and the empty
    barriers' (a group's CTAs share the lead's barrier: a zero basis)."""
    bits = _bases(cm, cn)
    acc = [[1, 0] if b == "m" else [0, 1] for b in bits]
    a = [[1, 0] if b == "m" else [0, 0] for b in bits]
    w = [[0, 0] if b == "m" else [1, 0] for b in bits]
    # barrier layouts are 1-D: bit i of the CTA id either selects its own barrier (2**k) or shares (0)
    def bar(shared: str):
        out, k = [], 0
        for b in bits:
            if b == shared:
                out.append([0])
            else:
                out.append([1 << k])
                k += 1
        return out
    return {"acc": acc, "a": a, "w": w, "empty_a": bar("n"), "empty_w": bar("m"), "ready": bar("")}


# The W group's release through global memory (gsync; cm = 2, cn = 1), one asm block for both CTAs of the pair: the
# peer (cluster rank 1) publishes that its consumers released step $2 - 1 (a release store of $2 after its own empty
# barrier's wait); the lead (rank 0) spins with acquire loads until the count reaches $2, then loads W into both.
_GSYNC_TEMPLATE = """{
.reg .pred p, lead;
.reg .b32 v, r;
mov.u32 r, %cluster_ctarank;
setp.eq.u32 lead, r, 0;
@!lead st.{store}.global.b32 [$1], $2;
@!lead bra DONE;
SPIN:
ld.{load}.global.b32 v, [$1];
setp.lt.s32 p, v, $2;
@p bra SPIN;
DONE:
mov.b32 $0, 0;
}"""


_DSMEM_TEMPLATE = """{
.reg .pred p, lead, first;
.reg .b32 v, r, a, ra;
.shared .align 1024 .b32 rlk_wflag[256];
mov.u32 r, %cluster_ctarank;
setp.eq.u32 lead, r, 0;
mov.u32 a, rlk_wflag;
setp.lt.s32 p, $2, 1;
@!lead bra PEER;
setp.eq.s32 first, $2, {first};
@first st.shared::cta.b32 [a], 0;
@p bra DONE;
add.s32 r, $2, {round};
and.b32 r, r, {mask};
SPIN:
ld.{load}.shared::cta.b32 v, [a];
setp.lt.s32 p, v, r;
@p bra SPIN;
bra DONE;
PEER:
@p bra DONE;
and.b32 r, $2, {odd};
setp.ne.s32 p, r, 0;
@p bra DONE;
mapa.shared::cluster.u32 ra, a, 0;
st.{store}.shared::cluster.b32 [ra], $2;
DONE:
mov.b32 $0, 0;
}"""


def gsync_asm(sync: str, stages: int) -> str:
    """The gsync block of `sync` for a ring of `stages` (its operand $2 is the count the lead waits for, gi - S + 1:
    1 - S at step 0)."""
    m = GSYNC_MODES[sync]
    if not m.shared:
        return _GSYNC_TEMPLATE.replace("{store}", m.store).replace("{load}", m.load)
    return (_DSMEM_TEMPLATE.replace("{store}", m.store).replace("{load}", m.load).replace("{first}", str(1 - stages))
            .replace("{round}", str(m.every - 1)).replace("{mask}", str(-m.every)).replace("{odd}", str(m.every - 1)))


if _IMPORT_ERROR is None:
    _PRODUCER_WARPS = gl.constexpr(1)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.jit
    def _producer(a_desc, w_desc, bufs_a, bufs_w, ready, empty_a, empty_w, num_pid_m, num_pid_n, k_steps, step,
                  flags, BMC: gl.constexpr, BNC: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                  MC_A: gl.constexpr, MC_W: gl.constexpr, GSYNC: gl.constexpr, GSYNC_ASM: gl.constexpr,
                  DSMEM: gl.constexpr):
        """One warp a CTA: every K step of this cluster's tiles into stage g % S once the CTAs that share each box
        released it (only a group's lead waits and issues a shared box)."""
        S: gl.constexpr = bufs_a.type.shape[0]
        flag = flags + gl.program_id(0)
        g = 0
        for t in range(gl.program_id(0), num_pid_m * num_pid_n, step):
            off_m, off_n = _origin(t, num_pid_m, num_pid_n, BMC, BNC, GROUP_M)
            for i in range(k_steps):
                gi = g + i
                s = gi % S
                ph = ((gi // S) & 1) ^ 1  # a fresh barrier counts as released once
                mbarrier.wait(empty_a.index(s), ph)
                if GSYNC:  # the lead loads W into both CTAs: it waits until the peer's consumers released step gi - S
                    if gi >= S or DSMEM:  # (inline PTX: Gluon would broadcast a scalar atomic's result through the
                        # cluster; DSMEM's block also runs at step 0, where the lead zeroes its shared counter)
                        gl.inline_asm_elementwise(GSYNC_ASM, "=r,l,r", [flag, gi - S + 1], dtype=gl.int32,
                                                  is_pure=False, pack=1)
                else:
                    mbarrier.wait(empty_w.index(s), ph)
                mbarrier.expect(ready.index(s), a_desc.nbytes_per_cta + w_desc.nbytes_per_cta)
                tma.async_load(a_desc, [off_m, i * BK], ready.index(s), bufs_a.index(s), multicast=MC_A)
                tma.async_load(w_desc, [off_n, i * BK], ready.index(s), bufs_w.index(s), multicast=MC_W)
            g += k_steps

    @gluon.jit
    def _release(empty_a, empty_w, s, pred, GSYNC: gl.constexpr):
        mbarrier.arrive(empty_a.index(s), count=1, pred=pred)
        if not GSYNC:
            mbarrier.arrive(empty_w.index(s), count=1, pred=pred)

    @gluon.jit
    def _segment(bufs_a, bufs_w, ready, empty_a, empty_w, g, sg, seg_steps, BMC: gl.constexpr, BNC: gl.constexpr,
                 acc_l: gl.constexpr, GSYNC: gl.constexpr):
        """Segment sg's chain from zero over its K steps (one wgmma in flight), each step's previous stage released."""
        S: gl.constexpr = bufs_a.type.shape[0]
        acc = gl.zeros((BMC, BNC), gl.float32, acc_l)
        for j in range(seg_steps):
            i = sg * seg_steps + j
            gi = g + i
            acc, _ = _k_step(bufs_a, bufs_w, bufs_w, ready, empty_a, gi, i > 0, acc, acc, 0)  # gemm_gluon's step
            if not GSYNC:  # step gi - 1 is free in the W group's barrier too
                mbarrier.arrive(empty_w.index((gi + S - 1) % S), count=1, pred=i > 0)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _consumer(bufs_a, bufs_w, ready, empty_a, empty_w, num_pid_m, num_pid_n, k_steps, step, c_ptr, M, N,
                  stride_cm, BMC: gl.constexpr, BNC: gl.constexpr, SEGS: gl.constexpr, GROUP_M: gl.constexpr,
                  acc_l: gl.constexpr, GSYNC: gl.constexpr):
        """Per cluster tile: each CTA's [128, 128] part, each segment's wgmma chain from zero (one step in flight),
        folded into the tree as it ends; bf16 out."""
        S: gl.constexpr = bufs_a.type.shape[0]
        seg_steps = k_steps // SEGS
        g = 0
        for t in range(gl.program_id(0), num_pid_m * num_pid_n, step):
            off_m, off_n = _origin(t, num_pid_m, num_pid_n, BMC, BNC, GROUP_M)
            lo = _segment(bufs_a, bufs_w, ready, empty_a, empty_w, g, 0, seg_steps, BMC, BNC, acc_l, GSYNC)
            hi = lo  # (s0 until segment 2 ends; no zero tile is carried: Triton 3.9 spilled one, 768 bytes)
            for sg in gl.static_range(1, SEGS):
                part = _segment(bufs_a, bufs_w, ready, empty_a, empty_w, g, sg, seg_steps, BMC, BNC, acc_l, GSYNC)
                lo, hi = _tree4(lo, hi, part, sg)
            _store(c_ptr, lo, off_m, off_n, M, N, stride_cm, BMC, BNC, acc_l)
            _release(empty_a, empty_w, (g + k_steps + S - 1) % S, True, GSYNC)  # the tile's last step is free
            g += k_steps

    @gluon.jit
    def _cluster_kernel(a_desc, w_desc, c_ptr, flags, M, N, K, stride_cm, step, BMC: gl.constexpr, BNC: gl.constexpr,
                        BK: gl.constexpr, SEGS: gl.constexpr, GROUP_M: gl.constexpr, acc_l: gl.constexpr,
                        EA_L: gl.constexpr, EW_L: gl.constexpr, RD_L: gl.constexpr, N_EA: gl.constexpr, N_EW: gl.constexpr,
                        N_RD: gl.constexpr, STAGES: gl.constexpr,
                        MC_A: gl.constexpr, MC_W: gl.constexpr, GSYNC: gl.constexpr, GSYNC_ASM: gl.constexpr,
                        DSMEM: gl.constexpr, num_warps: gl.constexpr):
        """C = A [M, K] @ W [N, K]^T in cluster tiles of [BMC, BNC]: cluster p takes tiles p, p + step, ...
        (persistent: step = the number of clusters)."""
        bufs_a = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        bufs_w = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, N_RD], RD_L)
        empty_a = gl.allocate_shared_memory(gl.int64, [STAGES, N_EA], EA_L)
        if GSYNC:  # no cross-CTA barrier at all (Triton 3.8's faulted on an H100: scripts/gpu_cluster_probe.py)
            empty_w = empty_a  # (unused)
        else:
            empty_w = gl.allocate_shared_memory(gl.int64, [STAGES, N_EW], EW_L)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty_a.index(i), count=1)
            if not GSYNC:
                mbarrier.init(empty_w.index(i), count=1)
        k_steps = gl.cdiv(K, BK)
        num_pid_m = gl.cdiv(M, BMC)
        num_pid_n = gl.cdiv(N, BNC)
        gl.warp_specialize([
            (_consumer, (bufs_a, bufs_w, ready, empty_a, empty_w, num_pid_m, num_pid_n, k_steps, step, c_ptr, M, N,
                         stride_cm, BMC, BNC, SEGS, GROUP_M, acc_l, GSYNC)),
            (_producer, (a_desc, w_desc, bufs_a, bufs_w, ready, empty_a, empty_w, num_pid_m, num_pid_n, k_steps,
                         step, flags, BMC, BNC, BK, GROUP_M, MC_A, MC_W, GSYNC, GSYNC_ASM, DSMEM)),
        ], [_PRODUCER_WARPS], [_PRODUCER_REGS])


def _count(bar_cga) -> int:
    """How many distinct barriers a barrier cga layout names (2 ** its non-zero bases)."""
    return 1 << sum(1 for b in bar_cga if b[0] != 0)


@functools.lru_cache(maxsize=None)
def _plan(tile: ClusterTile):
    """(A box layout, W box layout, the kernel's constexprs) of `tile`, built once (launch and compile_sm90)."""
    cg = cga_layouts(tile.cm, tile.cn)
    a_lay = gl.NVMMASharedLayout.get_default_for([tile.bm * tile.cm, BK], gl.bfloat16, cga_layout=cg["a"])
    w_lay = gl.NVMMASharedLayout.get_default_for([tile.bn * tile.cn, BK], gl.bfloat16, cga_layout=cg["w"])
    consts = dict(BMC=tile.bm * tile.cm, BNC=tile.bn * tile.cn, BK=BK, SEGS=tile.segs, GROUP_M=tile.group_m,
                  acc_l=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[tile.warps, 1],
                                                  instr_shape=[16, 128, 16], cga_layout=cg["acc"]),
                  EA_L=mbarrier.MBarrierLayout(cg["empty_a"]), EW_L=mbarrier.MBarrierLayout(cg["empty_w"]),
                  RD_L=mbarrier.MBarrierLayout(cg["ready"]),
                  N_EA=_count(cg["empty_a"]), N_EW=_count(cg["empty_w"]), N_RD=_count(cg["ready"]),
                  STAGES=tile.stages, MC_A=tile.cn > 1, MC_W=tile.cm > 1, GSYNC=tile.gsync,
                  GSYNC_ASM=gsync_asm(tile.sync, tile.stages), DSMEM=tile.shared_counter,
                  num_warps=tile.warps)
    return a_lay, w_lay, consts


def unavailable() -> str | None:
    if not _ENABLED:
        return f"{ENV}=0"
    return _IMPORT_ERROR


def launch(a, w, tile: ClusterTile, out=None, programs: int | None = None):
    """a [M, K] @ w [N, K]^T -> out [M, N] bf16 through `tile` (bf16, K a multiple of 64 x segs, TMA-loadable)."""
    import torch

    from .gemm_gluon import _sms
    from .gluon_checks import descriptor

    M, K = a.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty((M, N), device=a.device, dtype=a.dtype)
    a_lay, w_lay, consts = _plan(tile)
    a_desc = descriptor(a, [M, K], [a.stride(0), 1], [tile.bm * tile.cm, BK], a_lay)
    w_desc = descriptor(w, [N, K], [w.stride(0), 1], [tile.bn * tile.cn, BK], w_lay)
    tiles = -(-M // (tile.bm * tile.cm)) * -(-N // (tile.bn * tile.cn))
    grid = programs or min(tiles, _sms(a.device) // tile.ctas)
    # gsync through global memory: the W group's released-step counters, zeroed per launch (the dsmem modes zero their
    # shared counter in the kernel; other tiles never read the pointer)
    flags = torch.zeros(grid, device=a.device, dtype=torch.int32) if tile.gsync and not tile.shared_counter \
        else torch.empty(1, device=a.device, dtype=torch.int32)
    _cluster_kernel[(grid,)](a_desc, w_desc, out, flags, M, N, K, out.stride(0), grid, num_ctas=tile.ctas, **consts)
    return out


def compile_sm90(tile: ClusterTile):
    """`tile`'s kernel compiled for sm_90 here, with no GPU: the CompiledKernel (tests, scripts)."""
    from .gluon_checks import compile_sm90 as _compile_sm90

    a_lay, w_lay, const = _plan(tile)
    sig = {"a_desc": f"tensordesc<bf16[{tile.bm * tile.cm}, {BK}],{a_lay!r}>",
           "w_desc": f"tensordesc<bf16[{tile.bn * tile.cn}, {BK}],{w_lay!r}>",
           "c_ptr": "*bf16", "flags": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32", "step": "i32"}
    return _compile_sm90(_cluster_kernel, sig, const, num_warps=tile.warps, num_ctas=tile.ctas)

"""Batch-invariant GEMM (and fused SwiGLU) in Triton, under contracts.GemmContract.

y = a @ w.T (w [N, K], a linear layer's weight) or a @ b (b [K, N]). One tile config per
(dtype, N, K) class (contracts.gemm_config); no split-K; every output tile walks the
whole K range in the same order into one fp32 accumulator. The kernel is compiled with
M unspecialised, so the same binary serves every row count, and a row's accumulator sees
only its own row of `a`: its bits do not depend on M, its position, the tile walk or the
persistent grid size.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from ... import dispatch
from . import contracts as C
from . import gemm_gluon
from .ksegments import _fixup_merge, _k_scratch, _k_segments, _k_stream, _kept  # noqa: F401  (_kept: tests read it)
from .tile import _k_loop2, _k_span, _tile_coords
from .launch import fast, cdiv

_LOG2E = 1.4426950408889634


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_allocator():
    """Device-side TMA descriptors need scratch memory. Triton keeps its allocator per thread
    (a context variable), and autograd runs backwards on its own threads: set it every launch."""
    triton.set_allocator(_alloc)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbn, sbk, scm, scn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 NUM_PROGS: tl.constexpr, TMA: tl.constexpr, B_NK: tl.constexpr, IEEE: tl.constexpr,
                 SEGS: tl.constexpr = 1, SPLIT: tl.constexpr = False, K_FIXED: tl.constexpr = 0,
                 STREAM: tl.constexpr = False, FIXUP: tl.constexpr = False, ws_ptr=None, cnt_ptr=None,
                 BLOCK_N2: tl.constexpr = 0, SCRATCH: tl.constexpr = False, SLOTS: tl.constexpr = 0,
                 SLICED: tl.constexpr = False):
    """SPLIT: each (segment, tile) is its own work item; segment s's fp32 accumulator is stored at
    rows s*M .. s*M+M-1 of c (the host merges the segments by the same tree: same bits).
    FIXUP: the same work items, tile-major (a tile's segments run at about the same time); each
    partial goes to rows s*M + rm of ws [SEGS*M, N] fp32, then the tile's counter (cnt_ptr[tile],
    int32, zero at launch) is bumped; the program that finds it at SEGS - 1 merges the tile's
    partials by _fixup_merge into c and zeroes the counter again for the next launch. No program
    waits on another, and the tree's order does not depend on which one arrives last: same bits.
    K_FIXED > 0: K compiled in (the segmented schedules: every segment's K loop then has constant
    bounds, which the software pipeliner needs; a runtime start is the suspected cause of their
    slowness, H200_NOTES run 4). One compile per K; the arithmetic is the same.
    BLOCK_N2 > 0 (SEGS 1 only): tiles of BLOCK_N + BLOCK_N2 columns in two accumulators (_k_loop2).
    SCRATCH: the segments' tree with its waiting subtrees in ws_ptr, SLOTS fp32 tiles a program (_k_scratch: log2(SEGS),
    one more with SLICED, whose last merge stores the tile itself)."""
    if K_FIXED > 0:
        K = K_FIXED
    if TMA:
        a_src = tl.make_tensor_descriptor(a_ptr, [M, K], [sam, 1], [BLOCK_M, BLOCK_K])
        if B_NK:
            b_src = tl.make_tensor_descriptor(b_ptr, [N, K], [sbn, 1], [BLOCK_N, BLOCK_K])
        else:
            b_src = tl.make_tensor_descriptor(b_ptr, [K, N], [sbk, 1], [BLOCK_K, BLOCK_N])
        if BLOCK_N2 == 0:
            b2_src = b_src  # unused
        elif B_NK:
            b2_src = tl.make_tensor_descriptor(b_ptr, [N, K], [sbn, 1], [BLOCK_N2, BLOCK_K])
        else:
            b2_src = tl.make_tensor_descriptor(b_ptr, [K, N], [sbk, 1], [BLOCK_K, BLOCK_N2])
    else:
        a_src = a_ptr
        b_src = b_ptr
        b2_src = b_ptr
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N + BLOCK_N2)
    num_tiles = num_pid_m * num_pid_n
    total = num_tiles * SEGS if (SPLIT or FIXUP) else num_tiles
    # FIXUP unflattened: with its counter's `if` inside, flattening left the K loop unpipelined (sm_90 PTX, no cp.async)
    for item in tl.range(tl.program_id(0), total, NUM_PROGS, flatten=not FIXUP):
        tile = item // SEGS if FIXUP else item % num_tiles
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * (BLOCK_N + BLOCK_N2)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        if BLOCK_N2 > 0:  # the second accumulator's columns stored here, the first's below
            acc, acc2 = _k_loop2(a_src, b_src, b2_src, off_m, off_n, off_n + BLOCK_N, M, N, N, K, sam, sak, sbn, sbk,
                                 BLOCK_M, BLOCK_N, BLOCK_N2, BLOCK_K, TMA, B_NK, IEEE)
            rn2 = off_n + BLOCK_N + tl.arange(0, BLOCK_N2)
            tl.store(c_ptr + rm[:, None].to(tl.int64) * scm + rn2[None, :] * scn, acc2.to(c_ptr.dtype.element_ty),
                     mask=(rm[:, None] < M) & (rn2[None, :] < N))
            ptrs = c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
        elif SPLIT:
            seg = item // num_tiles
            ks = K // SEGS
            acc = _k_span(a_src, b_src, off_m, off_n, M, N, seg * ks, seg * ks + ks, sam, sak, sbn, sbk,
                          BLOCK_M, BLOCK_N, BLOCK_K, TMA, B_NK, IEEE)
            ptrs = c_ptr + (seg * M + rm[:, None]).to(tl.int64) * scm + rn[None, :] * scn
        elif FIXUP:
            seg = item % SEGS
            ks = K // SEGS
            acc = _k_span(a_src, b_src, off_m, off_n, M, N, seg * ks, seg * ks + ks, sam, sak, sbn, sbk,
                          BLOCK_M, BLOCK_N, BLOCK_K, TMA, B_NK, IEEE)
            tl.store(ws_ptr + (seg * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc,
                     mask=(rm[:, None] < M) & (rn[None, :] < N))
            # every thread's partial is stored before the one thread that runs a scalar atomic releases them
            tl.debug_barrier()
            if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SEGS - 1:
                _fixup_merge(ws_ptr, c_ptr, off_m, rn, M, N, scm, scn, BLOCK_M, SEGS)
                # relaxed: the next use of this counter is the next launch (every tile gets SEGS arrivals a launch)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
        elif SCRATCH:
            slots = ws_ptr + tl.program_id(0).to(tl.int64) * (SLOTS * BLOCK_M * BLOCK_N)
            acc = _k_scratch(a_src, b_src, off_m, off_n, M, N, K, sam, sak, sbn, sbk, slots, c_ptr, scm, scn,
                             BLOCK_M, BLOCK_N, BLOCK_K, TMA, B_NK, IEEE, SEGS, SLOTS - SLICED, SLICED)
            ptrs = c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
        elif STREAM:
            acc = _k_stream(a_src, b_src, off_m, off_n, M, N, K, sam, sak, sbn, sbk,
                            BLOCK_M, BLOCK_N, BLOCK_K, TMA, B_NK, IEEE, SEGS)
            ptrs = c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
        else:
            acc = _k_segments(a_src, b_src, off_m, off_n, M, N, K, sam, sak, sbn, sbk,
                              BLOCK_M, BLOCK_N, BLOCK_K, TMA, B_NK, IEEE, SEGS)
            ptrs = c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
        if not FIXUP and not (SCRATCH and SLICED):  # FIXUP's last arrival and SLICED's last merge store the tile above
            tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _silu_mul(g, u):
    """silu(g) * u in fp32 from values already rounded to the activation dtype (fp contraction off)."""
    t = g * (-1.4426950408889634)
    den = 1.0 + tl.exp2(t)
    return tl.div_rn(g, den) * u


@triton.jit(do_not_specialize=["M"])
def _gemm_swiglu_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbn, sbk, scm, scn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        NUM_PROGS: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr):
    """c[:, n] = silu(a @ w[n].T) * (a @ w[N + n].T), w [2N, K]."""
    if TMA:
        a_src = tl.make_tensor_descriptor(a_ptr, [M, K], [sam, 1], [BLOCK_M, BLOCK_K])
        b_src = tl.make_tensor_descriptor(b_ptr, [2 * N, K], [sbn, 1], [BLOCK_N, BLOCK_K])
    else:
        a_src = a_ptr
        b_src = b_ptr
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    out_ty = c_ptr.dtype.element_ty
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        accg, accu = _k_loop2(a_src, b_src, b_src, off_m, off_n, N + off_n, M, N, 2 * N, K, sam, sak, sbn, sbk,
                              BLOCK_M, BLOCK_N, BLOCK_N, BLOCK_K, TMA, True, IEEE)  # gate and up tiles of w [2N, K]
        g = accg.to(out_ty).to(tl.float32)
        u = accu.to(out_ty).to(tl.float32)
        y = _silu_mul(g, u)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        ptrs = c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
        tl.store(ptrs, y.to(out_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["n_elem"])
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n_elem, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _silu_mul(g, u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_rows_kernel(g_ptr, u_ptr, y_ptr, cols, sg, su, BLOCK: tl.constexpr):
    """_swiglu_kernel's arithmetic over rows with their own strides (gate and up as column slices of one [T, 2I]
    GEMM output): no copies first."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < cols
    g = tl.load(g_ptr + row * sg + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * cols + c, _silu_mul(g, u).to(y_ptr.dtype.element_ty), mask=mask)


def _is_fp32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32


@functools.lru_cache(maxsize=4096)  # called per launch: a pure function of its arguments (the tables are constants)
def schedule_config(dtype_name: str, n: int, k: int, m: int, k_segments: int = 1,
                    schedule: str | None = None) -> C.TileConfig:
    """The tile `matmul` runs without `config=`: the table's; fixup's by contracts.gpu.fixup_config; split's partials
    capped at 128 x 128 (bf16); registers and stream's live accumulators fitted by segments_config ("launches" runs
    plain GEMMs, "scratch" one live accumulator: the table's, capped at 128 x 128 like split's)."""
    if k_segments > 1 and schedule == "fixup":
        return C.fixup_config(dtype_name, n, k, m, k_segments)
    if k_segments > 1 and schedule in ("split", "scratch"):  # scratch: one accumulator live, the table's tile unfitted
        cfg = C.gemm_config(dtype_name, n, k, m)  # but capped (session 20: 128 x 256 sliced 0.26-0.57x, 128 x 128 0.42-0.64x)
        return C.BF16_GEMM["t128x128"] if dtype_name != "float32" and cfg.block_n * cfg.block_m > 128 * 128 else cfg
    if k_segments > 1 and schedule in ("registers", "stream"):
        return C.segments_config(dtype_name, n, k, m, k_segments)
    return C.gemm_config(dtype_name, n, k, m)


_SMEM_LIMIT = 232448  # bytes per block on sm_90


def _smem_bytes(cfg, stages: int, in_bytes: int, out_bytes: int, loops: int = 1) -> int:
    """Shared memory of a launch: `loops` pipelined K loops, each with its own `stages` buffers of an A and a B block,
    plus the output tile's staging buffer and 1 KiB of barriers. `loops` > 1: the "registers" schedule's segment loops
    on pointer loads (no TMA), which Triton 3.6 gives buffers each (the H200 refused 128 x 64 x 64, 3 stages, 4
    segments, bf16 out: "Required: 311296" = 4 x 3 x 24,576 + 16,384; with TMA the loops' buffers are shared, e.g. the
    0.6B o/down at 64 x 32 x 256, 4 stages, 4 segments run)."""
    n = cfg.block_n + cfg.block_n2
    return loops * stages * (cfg.block_m + n) * cfg.block_k * in_bytes + cfg.block_m * n * out_bytes + 1024


def _stages(cfg, in_bytes: int, out_bytes: int, loops: int = 1) -> int:
    """Pipeline depth that fits shared memory with this output dtype's epilogue (a wider output
    needs a larger staging buffer) and `loops` unshared K loops (_smem_bytes). The depth only changes when loads are
    issued, never the arithmetic: configs that differ only in stages give identical bits (tested)."""
    st = cfg.num_stages
    while st > 1 and _smem_bytes(cfg, st, in_bytes, out_bytes, loops) > _SMEM_LIMIT:
        st -= 1
    return st


def _tma_ok(cfg, *tensors) -> bool:
    if not cfg.tma:
        return False
    for t in tensors:
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


# the compiled kernel of the latest _gemm_kernel launch (None under the interpreter): scripts/gpu_gemm_sweep.py records
# its registers and spills beside each timing
_LAST_KERNEL: list = [None]

# how k segments run (matmul's docstring): the same bits under every one
SCHEDULES = ("launches", "split", "registers", "stream", "fixup", "scratch", "warpspec")

# "scratch" merges by 32-row slices from memory above this many tile elements: a loaded subtree beside a 128 x 256
# accumulator spills on sm_90 (ptxas -v, 4 segments: 220 bytes whole, none sliced); 128 x 128 and below merge in
# registers (8 bytes spilled at 128 x 128 w8, none at 64 x 128 w4)
SCRATCH_SLICED_ABOVE = 128 * 128

# "fixup"'s per-tile arrival counters, int32, all zero between launches (each launch's last arrivals zero them again):
# one buffer per (device, stream), so launches on two streams never share a counter; grown, never shrunk
_FIXUP_COUNTERS: dict[tuple, torch.Tensor] = {}
# buffers a grown one replaced: kept for the life of the process, never freed. A CUDA graph captured with the old buffer
# holds its address, not a reference (vLLM captures decode sizes, then a longer prefill grows the buffer): freed, that
# memory would go to other tensors and the graph's replays would count arrivals in them. They stay all zero (every
# launch zeroes what it counted), so a replay finds them ready.
_FIXUP_RETIRED: list[torch.Tensor] = []
_FIXUP_MIN_COUNTERS = 4096  # the first buffer's size (16 KiB): growth, and so retired buffers, are rare


def _fixup_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters for `tiles` tiles on the current stream. Under CUDA graph capture a missing buffer
    is made inside the graph (its memset replays with it) and not kept: a kept one would hold no zeros until
    the first replay. Capture on the stream that ran the warm-up (torch.cuda.graph(g, stream=s)) to reuse it."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream)
    buf = _FIXUP_COUNTERS.get(key)
    if buf is not None and buf.numel() >= tiles:
        return buf
    old = buf
    buf = torch.zeros(max(tiles, _FIXUP_MIN_COUNTERS, 2 * old.numel() if old is not None else 0), device=device,
                      dtype=torch.int32)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _FIXUP_COUNTERS[key] = buf
        if old is not None:
            _FIXUP_RETIRED.append(old)
    return buf


def matmul(a: torch.Tensor, weight: torch.Tensor | None = None, *, b: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, config: C.TileConfig | None = None,
           num_progs: int | None = None, k_segments: int = 1, schedule: str | None = None,
           out: torch.Tensor | None = None, num_ctas: int = 1) -> torch.Tensor:
    """a [M, K] @ weight[N, K].T (or @ b [K, N]) -> [M, N] in out_dtype (default a.dtype).

    config: override the contract's tile config (tuning and tests only: another config is
    another contract). num_progs: persistent grid size (default min(#SMs, tiles)); never
    changes a bit. k_segments (1, 2, 4 or 8, dividing K): K cut into equal segments, each its
    own fp32 accumulator, merged by a balanced binary tree before the one cast (bit for bit the
    per-segment GEMMs summed by rlkernel.tree_sum). schedule (how, never what: same bits):
    "launches" (default: one plain GEMM per segment into an fp32 buffer, the tree on the host),
    "split" (one launch, segments as separate work items, the tree on the host), "fixup" (split's
    work items, tile-major; the last of a tile's segments to finish merges the tile's fp32
    partials by the tree in the kernel: one launch with S x the work items for small M; its
    per-tile counters are kept per (device, stream): launches on one stream run one after
    another and two streams never share them, but two CUDA graphs captured on one stream do and
    must not replay concurrently; num_ctas 1 only), "registers" (one program walks every
    segment, the tree in registers), "scratch" (registers' walk with one accumulator live: a
    subtree awaiting its sibling waits in the program's fp32 slots, log2(S) tiles a program of
    a buffer allocated per call, so the tile keeps the table's width) or "stream" (registers'
    result from one K loop that folds each segment into the tree as it ends; 2 or 4 segments,
    K a multiple of segments x block_k) or "warpspec" (sm_90: the Gluon kernel's warp-specialised consumer folds
    each segment into the tree as it ends, gemm_gluon; where its rule picks no tile or it does not serve, "scratch").
    With the contract's tiles (config None), one segment and a weight, sm_90 may run a Gluon tile of 96 / 192
    columns where gemm_gluon.pick names one (same bits: checked at first use per device and tile).
    out: write here ([M, N], out_dtype) instead. num_ctas (tuning only, sm_90: a
    program as a cluster of CTAs splitting its tile by rows or columns, never by K): the
    sweep's question whether clusters help small M.
    """
    if k_segments not in (1, 2, 4, 8):
        raise ValueError(f"matmul: k_segments must be 1, 2, 4 or 8, got {k_segments}")
    if (weight is None) == (b is None):
        raise ValueError("matmul: give exactly one of weight [N, K] or b [K, N]")
    if a.dim() != 2:
        raise ValueError(f"matmul: a must be [M, K], got {tuple(a.shape)}")
    M, K = a.shape
    if weight is not None:
        N = weight.shape[0]
        if weight.shape[1] != K:
            raise ValueError(f"matmul: weight {tuple(weight.shape)} does not match K={K}")
        bt, sbn, sbk, b_nk = weight, weight.stride(0), weight.stride(1), True
    else:
        N = b.shape[1]
        if b.shape[0] != K:
            raise ValueError(f"matmul: b {tuple(b.shape)} does not match K={K}")
        bt, sbn, sbk, b_nk = b, b.stride(1), b.stride(0), False
    if bt.dtype != a.dtype:
        raise ValueError(f"matmul: dtypes differ ({a.dtype} vs {bt.dtype})")
    if K % k_segments:
        raise ValueError(f"matmul: K={K} is not divisible into {k_segments} segments")
    schedule = (schedule or "launches") if k_segments > 1 else None
    if schedule not in (None, *SCHEDULES):
        raise ValueError(f"matmul: unknown schedule {schedule!r}")
    if num_ctas not in (1, 2, 4):
        raise ValueError(f"matmul: num_ctas must be 1, 2 or 4, got {num_ctas}")
    if config is not None and config.block_n2 and k_segments > 1:
        raise ValueError(f"matmul: a two-accumulator tile (block_n2={config.block_n2}) runs unsegmented GEMMs only "
                         f"(k_segments={k_segments})")
    if schedule in ("fixup", "scratch") and num_ctas != 1:  # a cluster's CTAs share a program id (counter, slots)
        raise ValueError(f"matmul: schedule {schedule!r} keeps per-program state: num_ctas must be 1")
    if config is None and weight is not None and num_ctas == 1 and num_progs is None and M > 0 and \
            schedule in (None, "warpspec"):  # the contract's tiles: a Gluon tile where one is measured faster
        tile = gemm_gluon.choose(a, weight, k_segments, out_dtype, out)
        if tile is not None:
            _LAST_KERNEL[0] = None
            dispatch.note_kernel(lambda: f"gemm gluon {tile.name}")
            return gemm_gluon.launch(a, weight, tile, out)
    if schedule == "warpspec":  # where no Gluon tile serves: the schedule it replaced (the same bits)
        schedule = "scratch"
    if out is None:
        out = torch.empty((M, N), device=a.device, dtype=out_dtype or a.dtype)
    if M == 0:
        return out
    if schedule == "launches":
        ks = K // k_segments
        parts = torch.empty((k_segments, M, N), device=a.device, dtype=torch.float32)
        for i in range(k_segments):
            lo, hi = i * ks, (i + 1) * ks
            if weight is not None:
                matmul(a[:, lo:hi], weight[:, lo:hi], config=config, num_progs=num_progs, out=parts[i])
            else:
                matmul(a[:, lo:hi], b=b[lo:hi], config=config, num_progs=num_progs, out=parts[i])
        p = parts
        while p.shape[0] > 1:  # the balanced binary tree over adjacent segments
            p = p[0::2] + p[1::2]
        out.copy_(p[0])
        return out
    cfg = config if config is not None else schedule_config(C.dtype_name(a.dtype), N, K, M, k_segments, schedule)
    fixup = schedule == "fixup"
    scratch = schedule == "scratch"
    split = schedule == "split"
    stream = schedule == "stream"
    if stream and (k_segments not in (2, 4) or K % (k_segments * cfg.block_k)):
        raise ValueError(f"matmul: schedule 'stream' needs 2 or 4 segments and K a multiple of segments x block_k "
                         f"(K={K}, {k_segments} segments, block_k={cfg.block_k}); use 'registers'")
    final = out
    if split:
        out = torch.empty((k_segments * M, N), device=a.device, dtype=torch.float32)
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n + cfg.block_n2)
    extra = {}
    if fixup:  # fp32 partials, then the counters the last arrival finds (zero now, zero again after the launch)
        extra = {"ws_ptr": torch.empty((k_segments * M, N), device=a.device, dtype=torch.float32),
                 "cnt_ptr": _fixup_counters(a.device, tiles)}
    tiles *= k_segments if (split or fixup) else 1
    progs = min(num_progs or max(1, _num_sms(a.device) // num_ctas), tiles)
    if scratch:  # each program's slots for the tree's waiting subtrees (never read before written in a launch)
        sliced = cfg.block_m * cfg.block_n > SCRATCH_SLICED_ABOVE
        slots = k_segments.bit_length() - 1 + sliced
        extra = {"ws_ptr": torch.empty(progs * slots * cfg.block_m * cfg.block_n, device=a.device, dtype=torch.float32),
                 "SCRATCH": True, "SLOTS": slots, "SLICED": sliced}
    # TMA zero-fills only at the end of K: a segment boundary inside a K block would read the
    # next segment's values, so such splits take the masked-pointer path (same bits)
    tma = _tma_ok(cfg, a, bt) and (k_segments == 1 or (K // k_segments) % cfg.block_k == 0)
    if tma:
        _ensure_allocator()
    dispatch.note_kernel(lambda: f"gemm triton {cfg.block_m}x{cfg.block_n}" + (f"+{cfg.block_n2}" if cfg.block_n2 else "")
                         + f"x{cfg.block_k} w{cfg.num_warps}" + (" tma" if tma else "")
                         + (f", {k_segments} K segments {schedule}" if k_segments > 1 else ""))
    _LAST_KERNEL[0] = _gemm_kernel_fast[(progs,)](
        a, bt, out, M, N, K, a.stride(0), a.stride(1), sbn, sbk, out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGS=progs, TMA=tma, B_NK=b_nk, IEEE=_is_fp32(a), SEGS=k_segments, SPLIT=split,
        K_FIXED=K if k_segments > 1 else 0, STREAM=stream, FIXUP=fixup, **extra,
        **({"BLOCK_N2": cfg.block_n2} if cfg.block_n2 else {}),
        num_warps=cfg.num_warps,
        num_stages=_stages(cfg, a.element_size(), out.element_size(),
                           k_segments if schedule in ("registers", "scratch") and not tma else 1),
        **({"num_ctas": num_ctas} if num_ctas != 1 else {}))
    if split:  # the segments' balanced binary tree, adjacent pairs: the in-register tree's bits
        p = out.view(k_segments, M, N)
        while p.shape[0] > 1:
            p = p[0::2] + p[1::2]
        final.copy_(p[0])
        return final
    return out


def matmul_swiglu(x: torch.Tensor, gate_up_weight: torch.Tensor, *, config: C.TileConfig | None = None,
                  num_progs: int | None = None) -> torch.Tensor:
    """silu(x @ Wg.T) * (x @ Wu.T) for gate_up_weight = [Wg; Wu] of shape [2I, K] -> [M, I] in x.dtype, one launch.

    The bits of `matmul(x, gate_up_weight)` split into its halves and passed to `swiglu`: each accumulator is the
    GEMM's (same K walk), rounded to x.dtype before the epilogue runs `swiglu`'s arithmetic (`_silu_mul`). config:
    tuning and tests only (default `contracts.gpu.swiglu_config`: scheduling, never bits)."""
    if x.dim() != 2:
        raise ValueError(f"matmul_swiglu: x must be [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    if gate_up_weight.dim() != 2 or gate_up_weight.shape[1] != K or gate_up_weight.shape[0] % 2:
        raise ValueError(f"matmul_swiglu: weight {tuple(gate_up_weight.shape)} is not [2I, {K}]")
    if gate_up_weight.dtype != x.dtype:
        raise ValueError(f"matmul_swiglu: dtypes differ ({x.dtype} vs {gate_up_weight.dtype})")
    N = gate_up_weight.shape[0] // 2
    cfg = config or C.swiglu_config(C.dtype_name(x.dtype), N, K, M)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    progs = min(num_progs or _num_sms(x.device), tiles)
    tma = _tma_ok(cfg, x, gate_up_weight)
    if tma:
        _ensure_allocator()
    # a stage holds one x tile and two weight tiles (gate and up)
    stages = _stages(replace(cfg, block_n=2 * cfg.block_n), x.element_size(), out.element_size())
    _gemm_swiglu_kernel_fast[(progs,)](
        x, gate_up_weight, out, M, N, K, x.stride(0), x.stride(1), gate_up_weight.stride(0), gate_up_weight.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGS=progs, TMA=tma, IEEE=_is_fp32(x),
        num_warps=cfg.num_warps, num_stages=stages, enable_fp_fusion=False)
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Element-wise silu(gate) * up with the fused epilogue's exact arithmetic."""
    if gate.shape != up.shape:
        raise ValueError("swiglu: shapes differ")
    strided_rows = gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1
    if strided_rows and not (gate.is_contiguous() and up.is_contiguous()):
        rows, cols = gate.shape
        y = torch.empty((rows, cols), device=gate.device, dtype=gate.dtype)
        if rows and cols:
            _swiglu_rows_kernel_fast[(rows, cdiv(cols, 1024))](gate, up, y, cols, gate.stride(0), up.stride(0),
                                                                  BLOCK=1024, num_warps=4, enable_fp_fusion=False)
        return y
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        _swiglu_kernel_fast[(cdiv(n, 1024),)](g, u, y, n, BLOCK=1024, num_warps=4, enable_fp_fusion=False)
    return y

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_gemm_kernel_fast = fast(_gemm_kernel)
_gemm_swiglu_kernel_fast = fast(_gemm_swiglu_kernel)
_swiglu_rows_kernel_fast = fast(_swiglu_rows_kernel)
_swiglu_kernel_fast = fast(_swiglu_kernel)

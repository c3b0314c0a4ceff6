"""The GPU contracts (family "triton-sm90"): what the Triton kernels' bits depend on, as data.

What this module decides: every tile size, split size, walk and rounding point of the GPU
strict path, and the one function from (dtype, N, K) to a GEMM tile config. A tile config
is chosen by the operands' dtype and the weight's shape only, never by the row count, so a
row's bits never depend on how many rows share the call. The kernels
(`rlkernel/backends/triton/`) take their configs from here and nowhere else.

Why a second family next to "strict": a tensor-core GEMM (wgmma) sums products in the
hardware's own k16 groups, which no CPU reproduces at useful speed; the CPU contract is one
fma chain per output. The two families are each exact and invariant on their own devices;
rollout and training agree bit for bit when both run the same family (both on the GPU).
`arch` names the chip the bits were proved on; another arch runs the same order but is
another contract until its golden bits are checked (scripts/gpu_triton_checks.py).

Imports nothing heavy: a CPU-only machine can read, diff and hash these.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .base import Contract
from .rope import STRICT as _ROPE_STRICT

ARCH = "sm_90"  # NVIDIA H100/H200; Triton 3.6 (wgmma)
FAMILY = "triton-sm90"


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    group_m: int = 8  # tile walk (L2 locality only: never changes a bit)
    tma: bool = True  # operands through the bulk tensor copy engine (never changes a bit)
    block_n2: int = 0  # > 0: a second accumulator of this many columns after block_n's (tile._k_loop2): tiles of
    #                    block_n + block_n2 columns, a width a wave of SMs can divide (96, 192); scheduling only

    def __post_init__(self):
        for f in ("block_m", "block_n", "block_k") + (("block_n2",) if self.block_n2 else ()):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig: {f}={v} must be a power of two >= 16")


@dataclass(frozen=True)
class AttentionTiles:
    block_m: int = 64  # query tile rows = (block_m // group) tokens x group heads of one kv head
    block_n: int = 64  # kv chunk: keys [c*block_n, (c+1)*block_n), anchored at absolute position
    # fixed KV split size (a multiple of block_n), anchored at absolute position. 2,048 since attention v2 (session 42;
    # 512 in v1): the three-consumer Gluon prefill runs 0.91-0.94x SDPA with rare folds against 0.83-0.85x at 512
    # (H100, benchmarks/H100_session42); the paged decode at batch >= 64 is unchanged, at batch 1-8 with 4,096-key
    # contexts it has a quarter of v1's splits (benchmarks/H200_NOTES.md, session 42)
    seg_keys: int = 2048
    num_warps: int = 4
    num_stages: int = 3
    page_size: int = 16


# ---- tile configs ----------------------------------------------------------------------------
# On sm_90 a bf16 tile's bits are those of its wgmma k16 chain, whatever the tile: every config
# below gave identical bits at every row (scripts/gpu_strict_parity.py, "gemm_bits_vs_config",
# benchmarks/h200_strict_parity.json), so a config is a scheduling choice and may follow the row
# count. The table is still part of the contract (its id changes with it), and every config has
# block_m >= 64 so Triton lowers it to wgmma (smaller tiles would use mma.sync, another order).
# Chosen on the H200 by scripts/gpu_gemm_sweep.py (benchmarks/h200_gemm_sweep*.json: up to 24 candidates at the
# Qwen3-8B and Qwen3-0.6B shapes, M = 1 ... 4096, every one bit-equal to the others, timed against cuBLAS in a
# CUDA-graph chain over distinct weights). The classes are by the weight's N and the row count M; fp32 ('ieee' fma)
# keeps one config.
BF16_GEMM = {
    "t64x32": TileConfig(64, 32, 256, 4, 4),  # N <= 1024, M <= 256 (0.6B o/down, M=256: 0.66 -> 0.89x, 0.61 -> 0.84x)
    "t64x128": TileConfig(64, 128, 128, 4, 4),  # 1024 < N < 16384 at M <= 512 (N <= 4096: M <= 256); N <= 1024 at
    #                                             256 < M <= 1024; N >= 16384 at 64 < M <= 256
    "t64x256": TileConfig(64, 256, 64, 4, 4),  # N >= 16384, M <= 64 (streams the weight: 0.84-0.96x)
    "t128x128": TileConfig(128, 128, 64, 4, 8),  # 4096 < N < 16384 at 512 < M <= 1024; 1024 < N <= 4096 at 256 < M <= 512
    "t128x256": TileConfig(128, 256, 64, 3, 8),  # M > 1024 (any N); N >= 16384 at M > 256 (0.99-1.07x); 1024 < N <= 4096
    #                                               at 512 < M <= 1024
}
FP32_GEMM = TileConfig(64, 64, 32, 3, 4, tma=False)
LOGPROB_BF16 = TileConfig(128, 256, 64, 3, 8)  # the fused linear-logprob's own tile
FIXUP_TILE = replace(BF16_GEMM["t128x256"], tma=False)  # the "fixup" schedule's large tile (fixup_config)
ATTENTION_TILES = AttentionTiles()


def attention_head_dim_ok(d: int) -> bool:
    """Whether the Triton attention tiles a head dim: a power of two >= 16 (tl.arange(0, D); the tensor-core dot's
    K >= 16). The kernels refuse others, and `vime train`'s preflight before any engine starts."""
    return d >= 16 and not d & (d - 1)


def dtype_name(dtype) -> str:
    """A torch dtype as the config functions below name it ("bfloat16", "float32")."""
    return str(dtype).replace("torch.", "")


def gemm_class(n: int, k: int, m: int | None = None) -> str:
    """The BF16_GEMM entry for a weight [N, K] and M rows (None: large). Scheduling only: every entry gives the same
    bits."""
    big = m is None or m > 1024
    if n >= 16384:
        return "t64x256" if not big and m <= 64 else "t64x128" if not big and m <= 256 else "t128x256"
    if big:
        return "t128x256"
    if n <= 1024:
        return "t64x32" if m <= 256 else "t64x128"
    if n <= 4096 and m > 256:  # 8B o/down shapes: one wave of 128 tiles on 132 SMs (M = 512: 0.79 -> 0.85-0.88x;
        return "t128x128" if m <= 512 else "t128x256"  # M = 1024: 0.83-0.93 -> 0.93-0.98x; session 12's table)
    return "t64x128" if m <= 512 else "t128x128"


def gemm_config(dtype_name: str, n: int, k: int, m: int | None = None) -> TileConfig:
    """The tile for a GEMM of weight [N, K] (and M rows: scheduling only, see above)."""
    if dtype_name in ("float32", "torch.float32"):
        return FP32_GEMM
    return BF16_GEMM[gemm_class(n, k, m)]


_ACC_REGS = 128  # fp32 accumulator registers a thread that a tile's live accumulators may take


def _fit_accumulators(cfg: TileConfig, live: int) -> TileConfig:
    """cfg with its columns halved (down to 32) while `live` fp32 accumulators of its tile would take more than
    _ACC_REGS registers a thread. Scheduling only: the bits are the tile-independent wgmma chain."""
    while cfg.block_n > 32 and live * cfg.block_m * cfg.block_n > _ACC_REGS * 32 * cfg.num_warps:
        cfg = replace(cfg, block_n=cfg.block_n // 2)
    return cfg


# The GEMM + SwiGLU epilogue (`gemm.matmul_swiglu`) is registered as `rk.linear_swiglu`'s fusion only where it is worth
# it. On the H200 (session 12, benchmarks/h200_gemm_sweep_swiglu.json: 7 tiles x 7 M x the 8B and 0.6B gate/up, every
# one bit-equal to linear then swiglu) it lost to those two launches at every shape: best 0.56-0.83x stock cuBLAS +
# silu_and_mul against the two launches' 0.74-1.00x (two accumulators per tile, two weight tiles a stage). So the
# engine runs the GEMM, then SwiGLU on its output's halves (no copies); scripts/gpu_gemm_sweep.py --swiglu re-times it.
SWIGLU_EPILOGUE = False


def swiglu_config(dtype_name: str, n: int, k: int, m: int | None = None) -> TileConfig:
    """The tile of the GEMM + SwiGLU epilogue (`linear_swiglu`) for gate/up weights [2N, K] and M rows: the table's
    tile for a GEMM of N columns, fitted to its two accumulators (gate and up)."""
    if dtype_name in ("float32", "torch.float32"):
        return FP32_GEMM
    return _fit_accumulators(gemm_config(dtype_name, n, k, m), 2)


_LIVE_SEGMENT_ACCUMULATORS = {2: 2, 4: 3, 8: 4}  # the in-register tree's peak: finished partials and the running one


def segments_config(dtype_name: str, n: int, k: int, m: int | None, segments: int) -> TileConfig:
    """The tile of a GEMM over `segments` canonical K segments in one launch (`matmul`'s "registers" and "stream"
    schedules, the row-parallel layers at decode and prefill sizes): the table's tile for (N, M), fitted to the
    tree's live accumulators (2, 3 or 4 for 2, 4 or 8 segments)."""
    if dtype_name in ("float32", "torch.float32"):
        return FP32_GEMM
    return _fit_accumulators(gemm_config(dtype_name, n, k, m), _LIVE_SEGMENT_ACCUMULATORS[segments])


def fixup_config(dtype_name: str, n: int, k: int, m: int | None, segments: int, sms: int = 132) -> TileConfig:
    """The tile of a GEMM over `segments` canonical K segments as separate work items of one launch (`matmul`'s
    "fixup" schedule; the row-parallel layers): 128 x 256 with pointer loads wherever that tile gives at least 3/4 of
    a wave of work items (tiles x segments), else the table's tile capped at 128 x 128. One accumulator is live, so
    nothing is fitted. Session 13 (benchmarks/h200_gemm_sweep_segments4_fixup.json, 8B o/down, 4 segments, chain
    timer vs plain cuBLAS): at M = 256 the 128 x 256 pointer tile 0.56 / 0.77x against the capped table tile's 0.41 /
    0.53x; at M = 1,024 and 4,096 0.32-0.35 / 0.60-0.62x against 0.29-0.32 / 0.53-0.55x; at M <= 64 the table's tile
    (0.73-0.98x). Scheduling only: every tile gives the same bits (gemm_segments_bits_vs_config)."""
    if dtype_name in ("float32", "torch.float32"):
        return FP32_GEMM
    mm = 1 << 30 if m is None else m
    if -(-mm // FIXUP_TILE.block_m) * -(-n // FIXUP_TILE.block_n) * segments * 4 >= 3 * sms:
        return FIXUP_TILE
    cfg = gemm_config(dtype_name, n, k, m)
    return BF16_GEMM["t128x128"] if cfg.block_m * cfg.block_n > 128 * 128 else cfg


def logprob_config(dtype_name: str, v: int, h: int) -> TileConfig:
    return FP32_GEMM if dtype_name in ("float32", "torch.float32") else LOGPROB_BF16


def _tiles(cfg) -> tuple:
    """A config's fields as the contract lists them; block_n2 only where set (the ids of one-accumulator tables stay)."""
    return tuple(sorted((k, v) for k, v in asdict(cfg).items() if k != "block_n2" or v))


_MMA_ORDER = ("per output: one fp32 accumulator; K walked in order in wgmma k16 steps (bf16; the hardware's "
              "fixed order inside a step), whatever the tile's block_k; fp32 inputs: one config, 'ieee' fma, no "
              "TF32; no split-K; tail K zero-filled")

LINEAR = Contract(
    op="linear",
    backend=FAMILY,
    domain="K",
    partition=(("arch", ARCH), ("split_k", 1), ("m_independent", "kernel compiled with M unspecialised"),
               ("config", "bf16: gemm_class(N, K, M) (by N: <= 1024, < 16384, larger; by M: <= 64, 256, 512, 1024, "
                          "larger); fp32 one "
                          "config; K segments: each a plain GEMM into fp32, then the tree (one launch or in registers: same bits; "
                          "in registers the tile is segments_config: the table's, columns halved to fit the live "
                          "accumulators in 128 registers a thread); "
                          "bf16 bits proved independent of the tile on sm_90 (block_m >= 64: wgmma)"),
               *((f"bf16_{name}", _tiles(cfg)) for name, cfg in sorted(BF16_GEMM.items())),
               ("fp32", _tiles(FP32_GEMM)),
               ("k_segments", "caller, equal; each segment its own fp32 GEMM, partials by balanced binary tree")),
    merge=_MMA_ORDER,
    precision=(("input", "bf16 or fp32"), ("accumulate", "float32"), ("output", "x.dtype")),
    rounding=("one cast of the fp32 accumulator to x.dtype", "bias added to the fp32 accumulator before the cast",
              "backward: dx = g W and dW = g^T x, g in x.dtype, fp32 accumulate, same kernel and configs"),
    primitives=(("fp_contraction", "n/a (tensor core)"),),
    invariant=("batch (M)", "row position", "run to run", "tile walk / persistent grid size"),
    version=1,
)

RMS_NORM = Contract(
    op="rms_norm",
    backend=FAMILY,
    domain="hidden",
    partition=(("arch", ARCH), ("row", "one row per program"), ("block", "next_pow2(H), zero-padded"),
               ("num_warps", "8 if H >= 4096 else 4 (a function of H only)")),
    merge=("squares in fp32, summed by tl.sum over the fixed [BLOCK] layout: per-thread sequential, then warp "
           "butterfly, then across warps; identical for every row"),
    precision=(("input", "x.dtype"), ("accumulate", "float32"), ("output", "weight.dtype")),
    rounding=("residual add in fp32, rounded to x.dtype (the new residual)", "mean = sum / H (IEEE div)",
              "rstd = 1 / sqrt_rn(mean + eps) (IEEE)", "x * rstd rounded to x.dtype before the weight multiply",
              "weight multiply rounded to the weight dtype",
              "backward (training only): torch composition in fp32, deterministic for fixed shapes"),
    primitives=(("sqrt", "sqrt_rn"), ("div", "div_rn"), ("fp_contraction", "off")),
    invariant=("batch", "row position", "run to run"),
    version=1,
)

SWIGLU = Contract(
    op="swiglu",
    backend=FAMILY,
    domain="none (element-wise)",
    partition=(("arch", ARCH),),
    merge="none",
    precision=(("input", "activation dtype"), ("compute", "float32"), ("output", "activation dtype")),
    rounding=("silu(g) = g / (1 + exp2(-g * log2 e)) in fp32, IEEE divide", "product in fp32, one cast"),
    primitives=(("exp2", "ex2.approx.f32 (tl.exp2)"), ("fp_contraction", "off")),
    invariant=("batch", "position", "run to run",
               "linear_swiglu: the GEMM's epilogue rounds gate and up to the activation dtype, then this op's arithmetic "
               "(== linear then swiglu; interpreter test and scripts/gpu_gemm_sweep.py --swiglu)"),
    version=1,
)

ATTENTION = Contract(
    op="attention",
    backend=FAMILY,
    domain="visible keys",
    partition=(("arch", ARCH), ("tiles", _tiles(ATTENTION_TILES)),
               ("q_tile", "block_m rows = tokens x GQA heads of one kv head, same tile in every path"),
               ("kv_chunk", "block_n keys at absolute positions"),
               ("kv_split", "seg_keys keys at absolute positions (a fixed split size, never a number of splits)")),
    merge=("inside a segment: online softmax chunk by chunk, left to right, from (-inf, 0, 0); segments merged "
           "left to right from (-inf, 0, 0), in registers (one program) or by the combine kernel (split "
           "programs) with the same merge function"),
    precision=(("q,k,v", "bf16 (or fp32)"), ("scores", "float32"), ("p for p.v", "v.dtype"), ("m,l,o", "float32"),
               ("output", "q.dtype")),
    rounding=("s = q.k (tensor core, fp32)", "m = max(s) * (scale * log2 e)",
              "p = exp2(fma(s, scale * log2 e, -m)), rounded to v.dtype for p.v",
              "l = l * alpha + rowsum(p) (tl.sum, fixed layout)", "acc = acc * alpha + p.v",
              "segment merge: fma(L, a, l * b), fma(O, a, o * b)", "o = O / L (IEEE), one cast",
              "backward (training only): FlashAttention-2 style recompute, no atomics, fixed loops"),
    primitives=(("exp2", "ex2.approx.f32; alpha forced to exactly 1 when the max is unchanged"), ("max", "exact"),
                ("fp_contraction", "off (FMAs explicit)")),
    invariant=("batch", "prefill == decode == chunked prefill", "split == unsplit", "block table placement",
               "run to run"),
    version=2,  # v2 (session 42): seg_keys 512 -> 2,048
)

# FlashAttention 3 inside vLLM's build, with one KV split: a second GPU attention contract, opt-in
# (`rlkernel.ops.attention=fa3`, both engines). Its order is FA3's (its tiles and walk, chosen by its build), not
# written here; what rlkernel owns is the pin and the check: the implementation (rlkernel/backends/fa3.py) loads only
# where vLLM is this version, the chip this arch, and a probe reproduces the committed golden bits of that build
# (FA3_GOLDEN) with prefill == decode == chunked prefill == a sequence alone, bit for bit. Measured on an H200
# (benchmarks/h200_fa3_compare.json): those properties at 22,501 tokens and 1.78x the Triton kernel's prefill.
FA3_VLLM = "0.25.0"
FA3_ATTENTION = Contract(
    op="attention",
    backend="fa3-sm90",
    domain="visible keys",
    partition=(("arch", ARCH), ("kernel", f"vllm {FA3_VLLM} vllm_flash_attn, fa_version=3"), ("num_splits", 1),
               ("q,k,v", "bf16 or fp16 (no fp32 kernel)")),
    merge="FA3's: one program walks a query tile's keys in its fixed block order; no split, no combine",
    precision=(("q,k,v", "bf16/fp16"), ("scores, m, l, o", "float32"), ("output", "q.dtype")),
    rounding=("FA3's (its build)", "backward (training only): rlkernel's Triton recompute kernels fed FA3's out and "
              "log-sum-exp, no atomics, fixed loops"),
    primitives=(("exp2", "FA3's"),),
    invariant=("batch", "prefill == decode == chunked prefill", "block table placement", "run to run",
               "checked at load against the committed golden bits of this build (FA3_GOLDEN)"),
    version=1,
)

LOGPROB = Contract(
    op="linear_logprob",
    backend=FAMILY,
    domain="vocab [0, vocab_size)",
    partition=(("arch", ARCH), ("bf16", _tiles(LOGPROB_BF16)), ("fp32", _tiles(FP32_GEMM)),
               ("vocab_tile", "config.block_n rows of the lm_head"), ("padding_rows", "excluded (-inf)")),
    merge=("logits: " + _MMA_ORDER + "; per tile: m = max(z), l = tl.sum(exp2((z - m) * log2 e)); across tiles: "
           "balanced binary tree over tile index, identity-padded (-inf, 0) to a power of two"),
    precision=(("hidden,weight", "bf16 (or fp32)"), ("logits", "float32"), ("m,l", "float32"), ("output", "float32")),
    rounding=("z = acc / temperature (IEEE div)", "merge l = l1 * e1 + l2 * e2, e = 1 exactly when m_i == m",
              "lp = (z_target - m) - log(l)",
              "entropy = lse - mean_z, mean_z a balanced tree over VOCAB_TILE tiles of each tile's balanced tree "
              "of p * z (zero-padded to the tile)",
              "backward (training only): vocab chunks in order, g = (onehot - p) * dlp / T in fp32 cast to the "
              "weight dtype, dh summed over chunks in fp32 in order",
              "vocab-parallel backward (TP_BACKWARD_REFERENCE), bf16/fp16 head: dz of each vocab chunk from the fused "
              "kernel above (its tile logits on the hidden in the weight dtype, p = exp2((z - lse) * log2 e), "
              "dz = (onehot - p) * g / T cast to the weight dtype; column-invariant, so a chunk's dz is its tiles'), "
              "dW and the per-tile dh fold on tensor cores with float32 accumulate (v3; v2: IEEE float32 operands "
              "and torch's exp); a float32 head: as v2"),
    primitives=(("exp2", "ex2.approx.f32"), ("log", "tl.log (lg2.approx * ln 2)"), ("fp_contraction", "off")),
    invariant=("batch", "row position", "run to run",
               "vocab split over ranks at VOCAB_TILE boundaries (forward: rk.vocab_parallel_logprob / _entropy)"),
    version=3,
)

# RoPE on the GPU is the strict contract itself: a table of correctly rounded cos/sin (built on
# the CPU) and element-wise IEEE multiplies and adds, which every device rounds alike.
ROPE = _ROPE_STRICT

BY_OP = {"linear": LINEAR, "rms_norm": RMS_NORM, "swiglu": SWIGLU, "rope": ROPE, "attention": ATTENTION,
         "linear_logprob": LOGPROB}


def as_dict(obj) -> dict:
    return obj.as_dict() if isinstance(obj, Contract) else asdict(obj)

"""The GPU (Triton) contracts, as data: every constant a kernel's bits depend on.

Imports nothing heavy (no torch, no triton), so a CPU-only machine can read, diff and hash
these. A kernel in this package takes its tile config from here and nowhere else; a
config is chosen by (dtype, N, K) or (dtype, H, D) alone, never by the number of rows,
so a row's bits never depend on how many rows share the call.

Fields follow rlkernel's Contract tuple: domain D, partition, merge tree, precision,
rounding points, primitives. `arch` names the chip the tile configs were chosen (and
the bits proved) on; a different arch runs the same order but is a different contract
until the golden bits are checked there.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

ARCH = "sm_90 (NVIDIA H200, Triton 3.6, wgmma)"


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    group_m: int = 8  # tile walk (L2 locality only: never changes a bit)
    tma: bool = True  # operands through the bulk tensor copy engine (never changes a bit)


@dataclass(frozen=True)
class GemmContract:
    """y[m, n] = sum_k a[m, k] * w[n, k]; one tile config per (dtype, N, K) class."""
    op: str = "linear"
    backend: str = "triton"
    arch: str = ARCH
    domain: str = "K"
    config: TileConfig = field(default_factory=lambda: TileConfig(128, 256, 64, 3, 8))
    partition: tuple = (("split_k", 1), ("k_block", "config.block_k"), ("m_independent", True),
                        ("compiled_kernel", "M not specialised (do_not_specialize)"),
                        ("num_stages", "config.num_stages, lowered only where the output dtype's epilogue "
                                       "needs the shared memory (load timing only; bits tested equal)"))
    merge: str = ("one fp32 accumulator per output element; K walked 0, block_k, 2*block_k, ... in order, "
                  "each block one tl.dot (wgmma k16 steps in order) into the accumulator; tail K zero-filled")
    precision: tuple = (("input", "bf16 or fp32"), ("dot", "bf16 tensor core / fp32 'ieee' (no TF32)"),
                        ("accumulate", "float32"), ("output", "float32 or input dtype"))
    rounding: tuple = ("one cast of the fp32 accumulator to the output dtype",)
    primitives: tuple = ()
    invariant: tuple = ("batch (M)", "row position", "run to run", "tile walk / persistent grid size")
    version: int = 1


@dataclass(frozen=True)
class SwiGLUContract:
    """silu(x @ Wg.T) * (x @ Wu.T) with W = [Wg; Wu] stacked [2I, K] (Megatron/vLLM gate_up)."""
    op: str = "linear_swiglu"
    backend: str = "triton"
    arch: str = ARCH
    config: TileConfig = field(default_factory=lambda: TileConfig(128, 128, 64, 3, 8))
    merge: str = "as GemmContract, two accumulators (gate, up) walking the same K order"
    rounding: tuple = ("gate and up rounded to the activation dtype (the materialisation boundary)",
                       "silu(g) = g / (1 + exp2(-g * log2 e)) in fp32, IEEE divide",
                       "product in fp32, one cast to the activation dtype")
    primitives: tuple = (("exp2", "ex2.approx.f32 (tl.exp2)"), ("fp_contraction", "off"))
    invariant: tuple = ("batch (M)", "row position", "run to run", "fused == gemm then swiglu (tested)")
    version: int = 1


@dataclass(frozen=True)
class RMSNormContract:
    op: str = "rms_norm"
    backend: str = "triton"
    arch: str = ARCH
    domain: str = "hidden"
    partition: tuple = (("row", "one row per program"), ("block", "next_pow2(H), zero-padded"),
                        ("num_warps", "8 if H >= 4096 else 4 (a function of H only)"))
    merge: str = ("squares rounded to fp32, summed by tl.sum over the fixed [BLOCK] layout: per-thread "
                  "sequential, then warp butterfly, then across warps; identical for every row")
    precision: tuple = (("input", "x.dtype"), ("accumulate", "float32"), ("output", "x.dtype"))
    rounding: tuple = ("residual add in fp32, rounded to x.dtype (the new residual)",
                       "mean = sum / H (IEEE div)", "rstd = 1 / sqrt_rn(mean + eps) (IEEE)",
                       "x * rstd rounded to x.dtype before the weight multiply",
                       "weight multiply rounded to the weight dtype")
    primitives: tuple = (("sqrt", "sqrt_rn"), ("div", "div_rn"), ("fp_contraction", "off"))
    invariant: tuple = ("batch", "row position", "run to run")
    version: int = 1


@dataclass(frozen=True)
class AttentionContract:
    """Causal GQA attention; one formulation for packed prefill, paged decode and chunked prefill."""
    op: str = "attention"
    backend: str = "triton"
    arch: str = ARCH
    domain: str = "visible keys"
    block_m: int = 64  # query tile rows = (block_m // group) tokens x group heads of one kv head
    block_n: int = 64  # kv chunk: keys [c*block_n, (c+1)*block_n), anchored at absolute position
    seg_keys: int = 512  # fixed KV split size (a multiple of block_n), anchored at absolute position
    num_warps: int = 4
    num_stages: int = 3
    page_size: int = 16
    partition: tuple = (("q_tile", "block_m rows = tokens x GQA heads, same tile in every path"),
                        ("kv_chunk", "block_n keys at absolute positions"),
                        ("kv_split", "seg_keys keys at absolute positions (never a number of splits)"))
    merge: str = ("inside a segment: online softmax chunk by chunk, left to right, from (-inf, 0, 0); "
                  "segments merged left to right from (-inf, 0, 0), in registers (one program) or by "
                  "the combine kernel (split programs) with the same merge function")
    precision: tuple = (("q,k,v", "bf16 (or fp32)"), ("scores", "float32"), ("p for p.v", "v.dtype"),
                        ("m,l,o", "float32"), ("output", "q.dtype"))
    rounding: tuple = ("s = q.k (tensor core, fp32)", "m = max(s) * (scale * log2 e)",
                       "p = exp2(fma(s, scale * log2 e, -m)), rounded to v.dtype for p.v",
                       "l = l * alpha + rowsum(p) (tl.sum, fixed layout)", "acc = acc * alpha + p.v",
                       "segment merge: fma(L, a, l * b), fma(O, a, o * b)", "o = O / L (IEEE), one cast")
    primitives: tuple = (("exp2", "ex2.approx.f32; alpha forced to exactly 1 when the max is unchanged"),
                         ("max", "exact"), ("fp_contraction", "off (FMAs explicit)"))
    invariant: tuple = ("batch", "prefill == decode == chunked prefill", "split == unsplit",
                        "block table placement", "run to run")
    version: int = 1


@dataclass(frozen=True)
class LogprobContract:
    op: str = "linear_logprob"
    backend: str = "triton"
    arch: str = ARCH
    domain: str = "vocab [0, vocab_size)"
    config: TileConfig = field(default_factory=lambda: TileConfig(128, 256, 64, 3, 8))
    partition: tuple = (("vocab_tile", "config.block_n rows of the lm_head"), ("padding_rows", "excluded (-inf)"),
                        ("logits", "fp32 accumulator, K walked in order as in GemmContract"))
    merge: str = ("per tile: m = max(z), l = tl.sum(exp2((z - m) * log2 e)); across tiles: balanced binary "
                  "tree over tile index, identity-padded (-inf, 0) to a power of two")
    precision: tuple = (("hidden,weight", "bf16 (or fp32)"), ("logits", "float32"), ("m,l", "float32"),
                        ("output", "float32"))
    rounding: tuple = ("z = acc / temperature (IEEE div)", "merge l = l1 * e1 + l2 * e2, e = 1 exactly when m_i == m",
                       "lp = (z_target - m) - log(l)")
    primitives: tuple = (("exp2", "ex2.approx.f32"), ("log", "tl.log (lg2.approx * ln 2)"), ("fp_contraction", "off"))
    invariant: tuple = ("batch", "row position", "run to run")
    version: int = 1


# ---- tile configs: functions of (dtype, N, K) only --------------------------------------------

# bf16 classes, chosen on the H200 by the sweep in scripts/gpu_triton_checks.py (see
# benchmarks/h200_triton.json); the row count never enters.
BF16_GEMM = {
    "wide": TileConfig(64, 256, 64, 4, 4),  # N >= 16384 (gate_up, lm_head as a plain GEMM)
    "narrow": TileConfig(64, 128, 128, 4, 4),  # N < 16384 (qkv, o, down)
}
FP32_GEMM = TileConfig(64, 64, 32, 3, 4, tma=False)


def gemm_class(n: int, k: int) -> str:
    return "wide" if n >= 16384 else "narrow"


def gemm_config(dtype_name: str, n: int, k: int) -> TileConfig:
    if dtype_name in ("float32", "torch.float32"):
        return FP32_GEMM
    return BF16_GEMM[gemm_class(n, k)]


def gemm_contract(dtype_name: str, n: int, k: int) -> GemmContract:
    return GemmContract(config=gemm_config(dtype_name, n, k))


SWIGLU = SwiGLUContract()
RMSNORM = RMSNormContract()
ATTENTION = AttentionContract()


LOGPROB_BF16 = TileConfig(128, 256, 64, 3, 8)  # the fused op's own tile (fastest at T >= 256 on the H200)


def logprob_contract(dtype_name: str, v: int, h: int) -> LogprobContract:
    return LogprobContract(config=FP32_GEMM if dtype_name in ("float32", "torch.float32") else LOGPROB_BF16)


def as_dict(contract) -> dict:
    return asdict(contract)

"""The Triton implementation registered with rlkernel's dispatch: the ops' public signatures
on top of the kernels, and their deterministic backwards.

What this module decides: how each public op maps onto the kernels (shapes, the k-segment
tree, the bias, the fused-logprob kinds) and how gradients are computed on the GPU:
  linear       dx = g W, dW = g^T x through the same GEMM kernel and configs (g in x.dtype,
               fp32 accumulate); db by a balanced tree over rows
  rms_norm     one row per program (dx and the row's dw share), dw by a balanced tree over rows
  swiglu       the shared explicit backward's arithmetic (reference.swiglu.backward, torch.exp) in one
               launch (swiglu_bwd.py)
  rope         one launch (rope.py), the composition's bits; backward: the same kernel, sine negated
  attention    FlashAttention-2-style recompute kernels, no atomics (attention_bwd.py)
  linear_logprob / entropy   vocab chunks in fixed order: the chunk's logits recomputed with
               the forward's tile config, dz in fp32 cast to the weight dtype, dh summed
               over chunks in fp32 left to right, dW written per chunk
rlkernel.tree_sum on CUDA runs `reduce.tree_sum_rows` (the same tree in a few launches).
Every backward is deterministic for fixed shapes (no atomics, no split chosen by load);
only the forwards claim batch invariance (the rollout never differentiates).
Nothing here imports triton at module level: registration is cheap on a CPU-only machine,
and `available()` keeps dispatch from choosing this implementation there.
"""
from __future__ import annotations

import functools
import warnings

import torch

from ... import dispatch
from ...contracts import gpu as G
from ...contracts.logprob import VOCAB_TILE
from ..reference import norm as _ref_norm
from ..reference import rope as _ref_rope
from ..reference import swiglu as _ref_swiglu
from ..reference.linear import wants_grad
from ..reference import primitives as _ref_prims
from ..reference.primitives import Prims, tree_sum

VOCAB_CHUNK = 8192  # backward/entropy vocab chunk (a multiple of VOCAB_TILE and of every logprob tile's block_n)


@functools.cache
def _reduce():
    from . import reduce
    return reduce


@functools.cache
def _k():
    """The kernel modules, imported on first use (they import triton)."""
    from . import attention, gemm, logprob, norm
    return gemm, norm, attention, logprob


def available() -> bool:
    from . import available as _avail
    return _avail()


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 a @ b under the GEMM contract (Prims.matmul): a transposed weight view goes
    through the weight path, so a row-parallel partial equals the k-segment of `linear`.
    Batched operands ([..., M, K] @ [..., K, N], broadcast like torch.matmul) run one GEMM per
    batch item: the kernel's bits depend on the row and column alone, so each item has the bits
    it has alone (context parallelism's attention backward multiplies per head this way)."""
    gemm = _k()[0]
    if a.dim() > 2 or b.dim() > 2:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
        b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
        out = torch.empty((a3.shape[0], a.shape[-2], b.shape[-1]), dtype=torch.float32, device=a.device)
        for i in range(a3.shape[0]):
            out[i] = _mm32(a3[i], b3[i])
        return out.reshape(*batch, a.shape[-2], b.shape[-1])
    if b.dtype != a.dtype:
        b = b.to(a.dtype)
    if b.dim() == 2 and b.stride(0) == 1 and b.stride(1) != 1:
        return gemm.matmul(a.contiguous(), b.t(), out_dtype=torch.float32)
    return gemm.matmul(a.contiguous(), b=b, out_dtype=torch.float32)


def _fold(acc, a, b, tile):
    from .fold import fold_matmul

    return fold_matmul(acc, a, b, tile)


def _grad_z(hidden, weight, targets, lse, g, temperature, lo, hi):
    return _k()[3].grad_z(hidden, weight, targets, lse, g, temperature, lo, hi)


TRITON = Prims("triton", torch.exp, torch.log, _mm32, _fold, _grad_z)


# ---- linear -------------------------------------------------------------------------------

SCRATCH_MIN_N = 2048  # output widths from which a k-segment linear runs "scratch" above decode sizes (8B o/down: n 4,096)
REGISTERS_MAX_M = 512  # below SCRATCH_MIN_N: rows up to which it runs "registers" (above: "scratch")


@functools.lru_cache(maxsize=4096)  # called per k-segment linear: a pure function of its arguments
def segment_schedule(m: int, n: int, k: int, segments: int, dtype_name: str = "bfloat16") -> str | None:
    """How a k-segment linear of m rows runs (`gemm.matmul`'s schedule; every one gives the same bits). Session 20 on
    the H200 (benchmarks/h200_session20/h200_gemm_sweep_segments4_scratch.json: o and down at the 8B and 0.6B shapes,
    4 segments, M = 64-4,096, chain ratios vs plain cuBLAS; the schedules at their own tiles):
    - m <= 64: "fixup" (segments as separate work items, the tree by the last to finish): 8B o / down 0.72 / 0.94x,
      0.6B 0.78 / 0.95x, against registers 0.66 / 0.77 and 0.65 / 0.68x, scratch 0.46-0.63x.
    - m <= 128: "registers" (the tree in registers, the tile fitted to the live accumulators): 0.67-0.78x against
      fixup 0.47-0.70x and scratch 0.55-0.64x.
    - n >= SCRATCH_MIN_N (the 8B shapes) from m = 256: "scratch" (one accumulator live, waiting subtrees in fp32 slots,
      the table's tile capped at 128 x 128): o 0.68 / 0.55 / 0.55 / 0.55 / 0.64x at M = 256 / 512 / 1,024 / 2,048 / 4,096
      (128 x 128 tile from M = 1,024), down 0.77 / 0.74 / 0.77 / 0.74 / 0.78x, against registers 0.35-0.57x, fixup
      0.32-0.78x, one plain GEMM per segment ("launches", session 13's rule above 4,096 rows) 0.29-0.56x.
    - narrower outputs (the 0.6B's n = 1,024): "registers" up to REGISTERS_MAX_M rows (0.56-0.65x against scratch
      0.35-0.58x), "scratch" above (M = 1,024 0.46 / 0.54x, 2,048 0.45 / 0.51x, 4,096 0.42 / 0.49x; registers
      0.46 / 0.48, 0.43 / 0.42, 0.40 / 0.39x; launches 0.16-0.28x).
    Timed up to M = 4,096; larger M keeps scratch (its cost per tile does not grow with M).
    Session 28 (benchmarks/h200_session28/call2, scripts/gpu_gluon_gemm.py): where scratch ran, "warpspec" (the Gluon
    kernel's warp-specialised consumer, gemm_gluon) beat it at every row timed: 8B o / down M = 256 0.99 / 0.89x,
    1,024 0.78 / 0.84x, 4,096 0.77 / 0.87x cuBLAS, equal bits; gemm.matmul runs scratch where it does not serve.
    Session 29 (benchmarks/h200_session29/call2): with its 128 x 128 tile persistent above 256 rows, o / down 0.84 /
    0.87-0.91x at M = 512, 0.89 / 0.92x at 16,384 (scratch 0.57 / 0.76x, 0.65 / 0.79x)."""
    if segments <= 1:
        return None
    if m <= 64:
        return "fixup"
    if m <= 128:
        return "registers"
    if n >= SCRATCH_MIN_N or m > REGISTERS_MAX_M:
        return "warpspec"  # scratch where the Gluon consumer does not serve (gemm_gluon.pick; not sm_90)
    return "registers"


def _rows(x):
    """x as [rows, K] with a contiguous last dim (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _linear_fwd(x, weight, bias, k_segments):
    gemm = _k()[0]
    k, n = x.shape[-1], weight.shape[0]
    x2 = _rows(x)
    if bias is None and k_segments in (1, 2, 4, 8):
        # every schedule gives the same bits (gemm.matmul); which one runs is segment_schedule's (session 20's timings)
        schedule = segment_schedule(x2.shape[0], n, k, k_segments, G.dtype_name(x2.dtype))
        y = gemm.matmul(x2, weight, k_segments=k_segments, schedule=schedule)
    else:
        seg = k // k_segments
        parts = [gemm.matmul(x2[:, i * seg:(i + 1) * seg], weight[:, i * seg:(i + 1) * seg], out_dtype=torch.float32)
                 for i in range(k_segments)]
        acc = parts[0] if k_segments == 1 else tree_sum(torch.stack(parts, dim=-1), dim=-1)
        if bias is not None:
            acc = acc + bias.float()
        y = acc.to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, k_segments):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _linear_fwd(x, weight, bias, k_segments)

    @staticmethod
    def backward(ctx, g):
        gemm = _k()[0]
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, w.shape[0]).to(x.dtype).contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = gemm.matmul(g2, b=w).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gw = gemm.matmul(g2.t().contiguous(), b=x.reshape(-1, x.shape[-1]).contiguous(), out_dtype=w.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            gb = tree_sum(g2.float(), dim=0).to(ctx.bias_dtype)
        return gx, gw, gb, None


def linear(x, weight, bias=None, k_segments: int = 1):
    if wants_grad(x, weight, bias):
        return _LinearFn.apply(x, weight, bias, k_segments)
    return _linear_fwd(x, weight, bias, k_segments)


# ---- rms_norm, swiglu ---------------------------------------------------------------------

def _norm_fwd(x, weight, eps, residual):
    norm = _k()[1]
    if residual is None:
        return norm.rms_norm(x, weight, eps), x
    return norm.rms_norm(x, weight, eps, residual=residual)


class _RmsNormFn(_ref_norm.RmsNormFn):
    """The shared forward (kernel bits from `fwd`); the backward as one Triton row kernel."""

    @staticmethod
    def backward(ctx, gy, gh_out=None):
        h, w = ctx.saved_tensors
        gx, pw = _k()[1].rms_norm_backward(h, w, gy, ctx.eps, gh_out)
        gw = _ref_norm.reduce_weight_grad(ctx, pw, w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, (gx if ctx.has_residual else None), None


def rms_norm(x, weight, eps, residual=None):
    if wants_grad(x, weight, residual):
        return _RmsNormFn.apply(x, weight, eps, residual, _norm_fwd)
    y, h = _norm_fwd(x, weight, eps, residual)
    return y if residual is None else (y, h)


def _swiglu_bwd(gate, up, g):
    from . import swiglu_bwd

    return swiglu_bwd.backward(gate, up, g)


def swiglu(gate, up):
    return _ref_swiglu.swiglu(gate, up, prims=TRITON, fwd=lambda g, u: _k()[0].swiglu(g, u), bwd=_swiglu_bwd)


# (fusion, *shape key) -> True: the fused launch gave the composition's bits on its first call here; a str: why it is
# refused (it differed or failed), and the composition serves from then on
FUSION_CHECKS: dict[tuple, object] = {}


def _checked_fusion(key: tuple, fused, composition, rows: int):
    """fused() where FUSION_CHECKS[key] is True; else composition(). The first call for a key outside CUDA-graph
    capture (and with rows to compare) runs both and compares bits (torch.equal): a launch that differs or raises is
    refused for the process with a warning. A first call inside a capture (no sync possible) takes the composition."""
    state = FUSION_CHECKS.get(key)
    if state is True:
        return fused()
    if state is not None or not rows or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return composition()
    want = composition()
    try:
        got = fused()
        ok = torch.equal(got, want) or f"its output differs from the composition in {int((got != want).sum())} of " \
                                       f"{want.numel()} values"
    except Exception as e:  # noqa: BLE001 -- a launch that cannot build or run is refused, not fatal
        ok = f"{type(e).__name__}: {str(e)[:300]}"
    FUSION_CHECKS[key] = ok
    if ok is not True:
        warnings.warn(f"rlkernel: the fused {key[0]} is refused for {key[1:]} ({ok}); its ops run one by one instead")
    return want


def linear_swiglu(x, gate_up_weight):
    """linear then swiglu in one launch (the GEMM's SwiGLU epilogue, `gemm.matmul_swiglu`): forward only (the
    dispatcher runs the two ops when a gradient is wanted), checked at first use per (dtype, weight shape)
    (`_checked_fusion`)."""
    x2 = _rows(x)
    gemm = _k()[0]
    y = _checked_fusion(("linear_swiglu", str(x.dtype), *gate_up_weight.shape),
                        lambda: gemm.matmul_swiglu(x2, gate_up_weight),
                        lambda: gemm.swiglu(*_linear_fwd(x2, gate_up_weight, None, 1).chunk(2, dim=-1)), x2.shape[0])
    return y.reshape(*x.shape[:-1], y.shape[-1])


def rms_norm_rope(x, weight, eps, positions, theta, max_position=None):
    """rms_norm then rope in one launch (`norm.norm_rope`, reading a strided q/k view without a copy): forward only,
    checked at first use per (dtypes, head_dim, and whether the row strides are multiples of 16: what the compiled
    kernel's loads depend on) (`_checked_fusion`). The table and the position bound are rope's own."""
    from . import rope as _rope_kernel

    norm = _k()[1]
    key = ("rms_norm_rope", str(x.dtype), str(weight.dtype), x.shape[-1], x.stride(0) % 16 == 0, x.stride(1) % 16 == 0)

    def fwd(x, positions, cos, sin):
        return _checked_fusion(key, lambda: norm.norm_rope(x, weight, eps, positions, cos, sin),
                               lambda: _rope_kernel.forward(norm.rms_norm(x, weight, eps), positions, cos, sin),
                               x.shape[0] * x.shape[1])

    return _ref_rope.rope(x, positions, theta, fwd=fwd, max_position=max_position)


# ---- attention ----------------------------------------------------------------------------

class VarlenFn(torch.autograd.Function):
    """forward(q, k, v, cu_seqlens, scale, fwd): the forward's bits from fwd(q, k, v, cu, scale) -> (out, lse [T, Hq]
    float32) — the Triton kernel, or FA3 (backends/fa3.py); the backward: the Triton recompute kernels on that out/lse."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, fwd, max_seqlen=None):
        out, lse = fwd(q, k, v, cu_seqlens, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.scale, ctx.max_seqlen = scale, max_seqlen
        return out

    @staticmethod
    def backward(ctx, dout):
        from .attention_bwd import attention_varlen_backward
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = attention_varlen_backward(q, k, v, out, lse, dout.contiguous(), cu, scale=ctx.scale,
                                               max_seqlen=ctx.max_seqlen)
        return dq, dk, dv, None, None, None, None


def attention(kind, *args, max_query_len=None, max_seq_len=None):
    att = _k()[2]
    if kind == "varlen":  # max_query_len: the host's bound on the longest sequence (no read-back), else read here
        q, k, v, cu, scale = args
        if wants_grad(q, k, v):
            def fwd(q, k, v, cu_seqlens, scale):
                return att.attention_varlen(q, k, v, cu_seqlens, scale=scale, return_lse=True, max_seqlen=max_query_len)

            return VarlenFn.apply(q, k, v, cu, scale, fwd, max_query_len)
        return att.attention_varlen(q, k, v, cu, scale=scale, max_seqlen=max_query_len)
    q, kc, vc, bt, seq_lens, qsl, scale = args
    if wants_grad(q, kc, vc):
        raise dispatch.BackendUnavailable("rlkernel triton: paged attention is for inference; train with attention_varlen")
    return att.attention_paged(q, kc, vc, bt, seq_lens, qsl, scale=scale, max_query_len=max_query_len,
                               max_seq_len=max_seq_len)


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> bool:
    """The KV write without a host sync (the kernel skips negative slots itself) where the
    triton or fa3 implementation is the strict one on this device (an exact copy: the cache
    layout is the same); False elsewhere."""
    if k_cache.device.type != "cuda" or dispatch.resolve("attention", k_cache.device, "strict").name not in ("triton", "fa3"):
        return False
    if not _k()[2].write_kv_supported(k, v, k_cache, v_cache):
        return False  # rk.write_kv_cache's indexed copies serve
    _k()[2].write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return True


# ---- linear_logprob -----------------------------------------------------------------------

def _cfg(hidden, weight, vocab_size):
    return G.logprob_config(G.dtype_name(hidden.dtype), vocab_size, hidden.shape[1])


def _logits(hidden, weight, lo, hi, temperature):
    """float32 z = (hidden @ weight[lo:hi].T) / T, bit for bit the fused kernel's tile logits."""
    return _k()[0].matmul(hidden, weight[lo:hi], out_dtype=torch.float32, config=_cfg(hidden, weight, hi)) / temperature


def _stats(h, weight, temperature, vocab_size):
    """(lse, m, log l) per row from the fused kernel (its target output unused)."""
    dummy = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
    _, lse, m, log_l = _k()[3].linear_logprob(h, weight, dummy, temperature, vocab_size=vocab_size, return_stats=True)
    return lse, m, log_l


def _chunks(vocab_size):
    return [(lo, min(lo + VOCAB_CHUNK, vocab_size)) for lo in range(0, vocab_size, VOCAB_CHUNK)]


def entropy_tile_sums(h, weight, lse, temperature, lo, hi):
    """[T, tiles] float32: for each VOCAB_TILE tile of weight rows [lo, hi) (lo a tile multiple), the balanced tree
    over the tile's columns (zero-padded to the tile) of p * z, p = exp(z - lse). A tile's sum depends only on its
    own logits, so a vocab shard's tiles are exactly those of the whole vocab there (the vocab-parallel entropy)."""
    T, parts = h.shape[0], []
    step = max(VOCAB_TILE, VOCAB_CHUNK - VOCAB_CHUNK % VOCAB_TILE)  # whole tiles per chunk
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        z = _logits(h, weight, a, b, temperature)
        pz = torch.exp(z - lse[:, None]) * z
        n = -(-(b - a) // VOCAB_TILE)
        pz = torch.nn.functional.pad(pz, (0, n * VOCAB_TILE - (b - a)))
        parts.append(tree_sum(pz.view(T, n, VOCAB_TILE), dim=-1))
    return torch.cat(parts, dim=1) if parts else torch.zeros(T, 0, device=h.device)


def _vocab_backward(hidden, weight, temperature, vocab_size, grad_z, needs, fused_gz=None):
    """fused_gz(h, lo, hi) -> dz chunk in the weight dtype (a kernel), else grad_z on fp32 logits."""
    gemm = _k()[0]
    h = hidden.contiguous()
    gh = None
    gw = torch.zeros_like(weight) if needs[1] else None
    for lo, hi in _chunks(vocab_size):
        if fused_gz is not None:
            gz = fused_gz(h, lo, hi)
        else:
            gz = (grad_z(_logits(h, weight, lo, hi, temperature), lo, hi) / temperature).to(weight.dtype)
        if needs[0]:
            part = gemm.matmul(gz, b=weight[lo:hi], out_dtype=torch.float32)
            gh = part if gh is None else gh + part
        if needs[1]:
            gw[lo:hi] = gemm.matmul(gz.t().contiguous(), b=h, out_dtype=weight.dtype)
    return (gh.to(hidden.dtype) if gh is not None else None), gw


class _LogprobFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_size):
        lp, lse = _k()[3].linear_logprob(hidden, weight, targets, temperature, vocab_size=vocab_size, return_lse=True)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.vocab_size = temperature, vocab_size
        return lp

    @staticmethod
    def backward(ctx, g):
        hidden, weight, targets, lse = ctx.saved_tensors
        g = g.float()

        def grad_z(z, lo, hi):
            gz = -torch.exp(z - lse[:, None])
            rows = ((targets >= lo) & (targets < hi)).nonzero()[:, 0]
            gz[rows, targets[rows] - lo] += 1.0
            return gz * g[:, None]

        def fused_gz(h, lo, hi):
            return _k()[3].grad_z(h, weight, targets, lse, g, ctx.temperature, lo, hi)

        gh, gw = _vocab_backward(hidden, weight, ctx.temperature, ctx.vocab_size, grad_z, ctx.needs_input_grad[:2],
                                 fused_gz=fused_gz)
        return gh, gw, None, None, None


class _EntropyFn(torch.autograd.Function):
    """H = lse - sum_j p_j z_j (a balanced tree inside each VOCAB_TILE tile, then one over the tiles: the same
    tiles at every vocab split, see `entropy_tile_sums`); dH/dz_j = p_j (sum_i p_i z_i - z_j)."""

    @staticmethod
    def forward(ctx, hidden, weight, temperature, vocab_size):
        h = hidden.contiguous()
        lse = _stats(h, weight, temperature, vocab_size)[0]
        mean_z = tree_sum(entropy_tile_sums(h, weight, lse, temperature, 0, vocab_size), dim=-1)
        ctx.save_for_backward(h, weight, lse, mean_z)
        ctx.temperature, ctx.vocab_size = temperature, vocab_size
        return lse - mean_z

    @staticmethod
    def backward(ctx, g):
        h, weight, lse, mean_z = ctx.saved_tensors
        g = g.float()

        def grad_z(z, lo, hi):
            return torch.exp(z - lse[:, None]) * (mean_z[:, None] - z) * g[:, None]

        gh, gw = _vocab_backward(h, weight, ctx.temperature, ctx.vocab_size, grad_z, ctx.needs_input_grad[:2])
        return gh, gw, None, None


def _full(hidden, weight, temperature, vocab_size):
    """[T, V] log-softmax; element [t, v] equals the targets kernel's value at target v (same
    tile logits, same (m, log l), same two subtractions)."""
    h = hidden.contiguous()
    _, m, log_l = _stats(h, weight, temperature, vocab_size)
    z = _logits(h, weight, 0, vocab_size, temperature)
    return (z - m[:, None]) - log_l[:, None]


def linear_logprob(kind, hidden, weight, targets, temperature, vocab_size):
    if kind == "full":
        return _full(hidden, weight, temperature, vocab_size)
    if kind == "entropy":
        return _EntropyFn.apply(hidden, weight, temperature, vocab_size)
    h = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    if wants_grad(hidden, weight):
        return _LogprobFn.apply(h, weight, targets, temperature, vocab_size)
    return _k()[3].linear_logprob(h, weight, targets, temperature, vocab_size=vocab_size)


def rope(x, positions, theta, max_position=None):
    from . import rope as _rope_kernel

    return _ref_rope.rope(x, positions, theta, fwd=_rope_kernel.forward, max_position=max_position)


_ref_prims.register_tree_sum("cuda", lambda x2: _reduce().tree_sum_rows(x2), functools.cache(available))

for _op, _fn in (("linear", linear), ("rms_norm", rms_norm), ("swiglu", swiglu), ("rope", rope), ("attention", attention),
                 ("linear_logprob", linear_logprob)):
    dispatch.register(_op, "triton", G.BY_OP[_op], devices=("cuda",), available=available, prims=TRITON)(_fn)
if G.SWIGLU_EPILOGUE:  # off: slower than its two launches on the H200 at every shape measured (contracts/gpu.py)
    dispatch.register_fusion(("linear", "swiglu"), ("triton", "triton"), linear_swiglu)
dispatch.register_fusion(("rms_norm", "rope"), ("triton", "triton"), rms_norm_rope)

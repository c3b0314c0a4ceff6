"""RoPE under the strict contract (contracts/rope.py): the cos/sin table, the rotation, its backward."""
from __future__ import annotations

import threading

import torch

from ...contracts.rope import ROPE_BLOCK
from .linear import wants_grad

_LOCK = threading.Lock()
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
# tables a grown one replaced: kept for the life of the process, never freed. A CUDA graph captured with the old table
# holds its address, not a reference (vLLM captures its decode steps with a table sized from max_model_len; a scorer in
# the same process then grows it for a longer packed stream): freed, that memory would go to other tensors and every
# replay would rotate by whatever they hold (session 17: 789 of 961 logprobs off by up to 0.3 after an update). An old
# table's rows are the new one's first rows, so a replay that reads it is still right. Growth at least doubles the
# table, so what is kept is less than the live table's size.
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []


def rope_table(head_dim: int, n_positions: int, theta: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [>= n_positions, head_dim // 2] float32, grown in fixed blocks (at least doubling) and cached;
    a replaced table stays alive (`_RETIRED`)."""
    if head_dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {head_dim}")
    device = torch.device(device)
    key = (head_dim, float(theta), device)
    with _LOCK:
        cos, sin = _TABLES.get(key, (None, None))
        have = 0 if cos is None else cos.shape[0]
        if have >= n_positions:
            return cos, sin
        inv_freq = _inv_freq(head_dim, float(theta))
        new_c, new_s = [], []
        for start in range(have, max(n_positions, 2 * have), ROPE_BLOCK):
            pos = torch.arange(start, start + ROPE_BLOCK, dtype=torch.float64)
            ang = pos[:, None] * inv_freq[None, :]  # one IEEE float64 multiply: exact bits everywhere
            new_c.append(_round_f32(torch.cos(ang), ang, "cos"))
            new_s.append(_round_f32(torch.sin(ang), ang, "sin"))
        add_c = torch.cat(new_c).to(device)
        add_s = torch.cat(new_s).to(device)
        if cos is not None:
            _RETIRED.append((cos, sin))
        cos = add_c if cos is None else torch.cat([cos, add_c])
        sin = add_s if sin is None else torch.cat([sin, add_s])
        _TABLES[key] = (cos, sin)
        return cos, sin


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """float64 theta**(-2i/d), correctly rounded (mpmath): torch's float64 pow is a vectorised
    kernel whose last bit may depend on the ISA, and every angle inherits it."""
    import mpmath

    with mpmath.workprec(200):
        return torch.tensor([float(mpmath.mpf(theta) ** (-mpmath.mpf(2 * i) / head_dim)) for i in range(head_dim // 2)],
                            dtype=torch.float64)


def _round_f32(v64: torch.Tensor, ang: torch.Tensor, fn: str) -> torch.Tensor:
    """float32 of cos/sin(ang), correctly rounded. A float64 libm result (within ~1 ulp, but its
    last bit depends on the library and the ISA) rounds to the right float32 unless it lies
    within a few float64 ulps of a float32 rounding midpoint; those rare entries (about one in
    2^25) are recomputed exactly with mpmath."""
    r = v64.float()
    r64 = r.double()
    half_ulp32 = (torch.nextafter(r, torch.tensor(float("inf"))).double() - r64) / 2
    margin = 8 * v64.abs().clamp(min=2.0**-1000) * 2.0**-52
    risky = ((half_ulp32 - (v64 - r64).abs()).abs() <= margin) | ((half_ulp32 + (v64 - r64).abs()).abs() <= margin)
    if bool(risky.any()):
        import mpmath

        f = getattr(mpmath, fn)
        idx = risky.nonzero(as_tuple=True)
        exact = []
        for a in ang[idx].tolist():
            with mpmath.workprec(200):
                val = f(mpmath.mpf(a))
            with mpmath.workprec(24):  # one rounding to float32's 24-bit significand
                exact.append(float(+val))
        r[idx] = torch.tensor(exact, dtype=torch.float32)
    return r


def forward(x, positions, cos, sin):
    """[x1*c - x2*s, x2*c + x1*s] in fp32, one cast to x's dtype."""
    d = x.shape[-1]
    c = cos[positions].unsqueeze(-2)  # [T, 1, d/2]
    s = sin[positions].unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class RopeFn(torch.autograd.Function):
    """Forward bits from `fwd`; the backward is the inverse rotation (sin negated), element-wise."""

    @staticmethod
    def forward(ctx, x, positions, cos, sin, fwd):
        # constants, kept as attributes: the cached table may be an inference tensor (made under
        # vLLM's inference_mode in the same process), which save_for_backward refuses
        ctx.positions, ctx.cos, ctx.sin, ctx.fwd = positions, cos, sin, fwd
        return fwd(x, positions, cos, sin)

    @staticmethod
    def backward(ctx, g):
        return ctx.fwd(g.contiguous(), ctx.positions, ctx.cos, negated_sin(ctx.sin)), None, None, None, None


_NEG_SIN: list = [None]  # (the sine table, its negation): the last table's, computed once (negation is exact)


def negated_sin(sin: torch.Tensor) -> torch.Tensor:
    """-sin for the backward's inverse rotation, kept for the table it was made from (every layer's backward of one
    step uses the same cached table: one negation, not one per call)."""
    version = None if sin.is_inference() else sin._version  # a table made under inference mode has no version counter
    with _LOCK:
        hit = _NEG_SIN[0]
        if hit is not None and hit[0] is sin and hit[1] == version:
            return hit[2]
        neg = -sin
        _NEG_SIN[0] = (sin, version, neg)
        return neg


UNBOUNDED_TABLE = 1 << 22  # positions read back (no max_position) above this many rows: refused (~1 GiB of tables at d 128)


def mark_below(positions: torch.Tensor, bound: int) -> torch.Tensor:
    """Record that every entry of `positions` is below `bound` by construction (e.g. positions inside sequences packed
    into a stream of `bound` tokens), so `rope(..., max_position >= bound)` skips its device-side check for it."""
    positions._rk_below = int(bound)
    return positions


def _check_below(positions: torch.Tensor, n: int) -> None:
    if positions.numel():
        if positions.is_cuda:
            torch._assert_async(((positions >= 0) & (positions < n)).all(), "rope: a position is < 0 or >= max_position")
        else:
            lo, hi = (int(v) for v in torch.aminmax(positions))
            if lo < 0:
                raise ValueError(f"rope: positions must be >= 0, got {lo}")
            if hi >= n:
                raise ValueError(f"rope: position {hi} is >= max_position {n}")


def checked_below(positions: torch.Tensor, bound: int) -> torch.Tensor:
    """`positions` checked once against `bound` (on CUDA a device-side assert, no sync) and returned as a view marked
    below it: every rope call of one forward with `max_position >= bound` then skips its own check (a decoder's 2 calls
    a layer: one check a forward instead of 2 x layers). The caller's tensor is left unmarked."""
    _check_below(positions, int(bound))
    return mark_below(positions.view(positions.shape), bound)


def rope(x, positions, theta, *, fwd=forward, max_position=None):
    """max_position (a bound the caller knows, e.g. the engine's max_model_len): size the table
    from it instead of reading positions.max() back from the device (a sync); on CUDA the bound
    is then checked by a device-side assert."""
    d = x.shape[-1]
    if max_position is None:  # the table from the positions themselves (one read of them)
        lo, hi = (int(v) for v in torch.aminmax(positions)) if positions.numel() else (0, 0)
        if lo < 0:
            raise ValueError(f"rope: positions must be >= 0, got {lo}")
        if hi >= UNBOUNDED_TABLE:
            raise ValueError(f"rope: position {hi} without max_position would build (and keep) a table of {hi + 1:,} rows; "
                             f"pass max_position (the model's length limit)")
        n = hi + 1
    else:
        n = int(max_position)
        known = getattr(positions, "_rk_below", None)  # mark_below / checked_below: checked already
        if not (known is not None and known <= n):
            _check_below(positions, n)
    cos, sin = rope_table(d, n, theta, x.device)
    if wants_grad(x):
        return RopeFn.apply(x, positions, cos, sin, fwd)
    return fwd(x, positions, cos, sin)

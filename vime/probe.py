"""The two engines' call patterns of each op, replayed on this machine (for `vime doctor`).

What this module decides: the evidence `vime doctor` has beyond the contracts. A contract
that claims batch and prefill/decode invariance makes the call pattern irrelevant; one that
claims none (the native ops) leaves the bits to the library, and then only running the two
patterns tells. For each op the same rows are computed the way the rollout engine calls it
(decode batches of 1..max_num_seqs rows and prefill chunks of max_num_batched_tokens; attention
token by token against a paged KV cache; separate q/k/v and gate/up GEMMs; full-vocab
log-softmax then a gather) and the way the trainer calls it (one packed forward; fused QKV and
fc1; varlen attention; selected-token logprob; row-parallel GEMMs as canonical K-segment
partials merged by the tree), each under its own side's policy and thread count, and the rows
whose bits differ are counted. Inputs are built from integers (rlkernel.golden.ints) at the
model's dimensions, so every machine probes the same values.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import rlkernel as rk
from rlkernel.golden import ints
from rlkernel.models.decoder import DecoderConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    lengths: tuple  # token count of each probed sequence
    chunks: tuple  # rollout row-batch sizes, cycled over the packed rows (decode batches, prefill chunks)
    block_size: int  # KV-cache block size of the rollout engine
    temperature: float  # rollout temperature (the logprob op divides by it)


@contextlib.contextmanager
def side(policy: rk.ExecutionPolicy, threads: int):
    """Run under one engine's policy and thread count (restored on exit)."""
    set_threads = torch._C.set_num_threads  # the builtin: vLLM's CPU worker replaces torch.set_num_threads in its process
    old = torch.get_num_threads()
    set_threads(threads)
    try:
        with torch.no_grad(), rk.mode(policy.mode, impl=policy.impl or "auto", ops=dict(policy.ops)):
            yield
    finally:
        set_threads(old)


def _chunks(n: int, sizes: tuple) -> list[slice]:
    out, i, k = [], 0, 0
    while i < n:
        m = sizes[k % len(sizes)]
        out.append(slice(i, min(n, i + m)))
        i, k = i + m, k + 1
    return out


def _rows_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    same = (a.contiguous().view(torch.int32 if a.dtype == torch.float32 else torch.int16)
            == b.contiguous().view(torch.int32 if b.dtype == torch.float32 else torch.int16))
    return int((~same.all(dim=1)).sum())


def _chunked(fn, n, sizes, *xs):
    return torch.cat([fn(*(x[s] for x in xs)) for s in _chunks(n, sizes)])


def probe(op: str, d: DecoderConfig, sched: Schedule, rollout: tuple, trainer: tuple, dtype=torch.float32) -> tuple[int, int]:
    """(rows whose bits differ, rows compared) for `op`; rollout/trainer: (policy, threads)."""
    T, H, D, hq, hkv, inter = sum(sched.lengths), d.hidden_size, d.head_dim, d.num_heads, d.num_kv_heads, d.intermediate_size
    cu = torch.tensor([0, *sched.lengths]).cumsum(0)
    pos = torch.cat([torch.arange(n) for n in sched.lengths])
    unit = 1 / 578  # ints(...) * unit has an RMS of about 1 (uniform integers in [-1001, 1001])
    x = ints(T, H, seed=31, scale=unit, dtype=dtype)  # a normed hidden state
    w = lambda n, k, seed, gain=1.0: ints(n, k, seed=seed, scale=gain * unit / k ** 0.5, dtype=dtype)  # noqa: E731
    sizes = sched.chunks
    if op == "rms_norm":
        nw = (ints(H, seed=32, scale=1 / 4096) + 1).to(dtype)
        run_r = lambda: _chunked(lambda a: rk.rms_norm(a, nw, d.rms_norm_eps), T, sizes, x)  # noqa: E731
        run_t = lambda: rk.rms_norm(x, nw, d.rms_norm_eps)  # noqa: E731
    elif op == "swiglu":
        g, u = ints(T, inter, seed=33, scale=2 * unit, dtype=dtype), ints(T, inter, seed=34, scale=unit, dtype=dtype)
        run_r = lambda: _chunked(rk.swiglu, T, sizes, g, u)  # noqa: E731
        run_t = lambda: rk.swiglu(g, u)  # noqa: E731
    elif op == "linear":
        wq, wk, wv = w(hq * D, H, 35), w(hkv * D, H, 36), w(hkv * D, H, 37)
        wo, a = w(H, hq * D, 38), ints(T, hq * D, seed=39, scale=unit, dtype=dtype)
        segs = rk_segments(hq * D, d.row_segments)
        run_r = lambda: torch.cat([_chunked(lambda t: rk.linear(t, ww), T, sizes, x) for ww in (wq, wk, wv)]  # noqa: E731
                                  + [_chunked(lambda t: rk.linear(t, wo, k_segments=segs), T, sizes, a)], dim=1)
        run_t = lambda: torch.cat([rk.linear(x, torch.cat([wq, wk, wv])), _row_parallel(a, wo, segs)], dim=1)  # noqa: E731
    elif op == "rope":
        q = ints(T, hq, D, seed=40, scale=unit, dtype=dtype)
        order = torch.argsort(pos, stable=True)  # decode: step t rotates every sequence's token at position t
        run_r = lambda: _unpermute(torch.cat([rk.rope(q[s], pos[s], d.rope_theta) for s in _by_value(pos[order], order)]), order)  # noqa: E731
        run_t = lambda: rk.rope(q, pos, d.rope_theta)  # noqa: E731
    elif op == "attention":
        q = ints(T, hq, D, seed=41, scale=unit, dtype=dtype)
        k, v = ints(T, hkv, D, seed=42, scale=unit, dtype=dtype), ints(T, hkv, D, seed=43, scale=unit, dtype=dtype)
        run_r = lambda: _decode_attention(q, k, v, sched.lengths, sched.block_size)  # noqa: E731
        run_t = lambda: rk.attention_varlen(q, k, v, cu)  # noqa: E731
    elif op == "linear_logprob":
        emb = w(d.vocab_size, H, 44, gain=2.0)  # logits of a few units: every vocab entry counts in the sum
        tgt = torch.tensor([(i * 7919) % d.vocab_size for i in range(T)])
        temp = sched.temperature
        run_r = lambda: _chunked(lambda h, t: rk.linear_logprobs_full(h, emb, temp, vocab_size=d.vocab_size)  # noqa: E731
                                 .gather(1, t[:, None])[:, 0], T, sizes, x, tgt)
        run_t = lambda: rk.linear_logprob(x, emb, tgt, temp, vocab_size=d.vocab_size)  # noqa: E731
    else:
        raise ValueError(f"no probe for op {op!r}")
    with side(*rollout):
        out_r = run_r()
    with side(*trainer):
        out_t = run_t()
    return _rows_differ(out_r.float() if out_r.dtype != dtype else out_r, out_t.to(out_r.dtype)), T


def rk_segments(k: int, max_segments: int) -> int:
    from rlkernel.ops.linear import canonical_segments

    return canonical_segments(k, max_segments)


def _row_parallel(a, w, segs):
    """The trainer's o_proj/down_proj: Megatron's row-parallel linear of the rlkernel spec at TP=1."""
    if rk.current_policy().choice("linear") == "native":
        return rk.linear(a, w)
    from rlkernel.ops.linear import linear_segment_partials

    return rk.canonical_tree_sum(linear_segment_partials(a, w, segs)).to(a.dtype)


def _by_value(sorted_vals: torch.Tensor, order: torch.Tensor) -> list[torch.Tensor]:
    """Index groups of `order` with equal values (one decode step each)."""
    vals, counts = torch.unique_consecutive(sorted_vals, return_counts=True)
    return list(order.split(counts.tolist()))


def _unpermute(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def _decode_attention(q, k, v, lengths, block_size):
    """The rollout's attention: every token decoded against the paged cache, all live sequences per step."""
    hkv, D = k.shape[1], k.shape[2]
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    blocks = [-(-n // block_size) for n in lengths]
    # blocks handed out in reverse order: a table is not the identity (as in a running engine)
    total = sum(blocks)
    ids = list(range(total))[::-1]
    tables, i = [], 0
    for b in blocks:
        tables.append(ids[i:i + b])
        i += b
    width = max(blocks)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kc = torch.zeros(total, block_size, hkv, D, dtype=k.dtype)
    vc = torch.zeros_like(kc)
    out = torch.empty_like(q)
    for t in range(max(lengths)):
        live = [j for j, n in enumerate(lengths) if n > t]
        rows = torch.tensor([starts[j] + t for j in live])
        slots = torch.tensor([tables[j][t // block_size] * block_size + t % block_size for j in live])
        rk.write_kv_cache(k[rows], v[rows], kc, vc, slots)
        out[rows] = rk.attention_paged(q[rows], kc, vc, table[live], torch.tensor([t + 1] * len(live)),
                                       torch.arange(len(live) + 1))
    return out

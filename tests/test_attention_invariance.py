"""Claim 2 (prefill/decode invariance): strict attention for every token of every sequence
is bitwise identical between (a) packed variable-length prefill of many sequences,
(b) token-by-token decode against a paged KV cache, batched with other requests,
(c) chunked prefill at arbitrary chunk boundaries, (d) any block size and any placement
of the blocks — with sequence lengths crossing KV-chunk and block boundaries, GQA, fp32
and bf16. Also: a sequence prefilled alone equals the same sequence packed with others.

Negative control: native SDPA on the same inputs, decode against prefill — equal values asserted, its bits
recorded (helpers.record_native: they differed on the CPUs this ran on; another CPU's library may agree)."""
import random

import pytest
import torch


import rlkernel as rk
from helpers import record_native

pytestmark = pytest.mark.usefixtures("impl")  # each test: CPU kernels and torch composition

LENGTHS = [1, 31, 32, 33, 70, 97]
HQ, HKV, D = 4, 2, 16


def _qkv(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    mk = lambda h: torch.randn(total, h, D, generator=g).mul(2).to(dtype)  # noqa: E731
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(LENGTHS), 0)))
    return mk(HQ), mk(HKV), mk(HKV), cu


class PagedCache:
    """A paged KV cache with randomly placed blocks, as an engine would hand them out."""

    def __init__(self, block_size, dtype, seed, n_seqs, max_len):
        self.bs = block_size
        per_seq = -(-max_len // block_size)
        n_blocks = per_seq * n_seqs + 3
        rng = random.Random(seed)
        free = list(range(n_blocks))
        rng.shuffle(free)
        self.tables = torch.tensor([free[i * per_seq:(i + 1) * per_seq] for i in range(n_seqs)], dtype=torch.int32)
        self.k = torch.full((n_blocks, block_size, HKV, D), float("nan"), dtype=dtype)  # unwritten slots are NaN: must never be read
        self.v = torch.full_like(self.k, float("nan"))

    def write(self, seq, start, k, v):
        pos = torch.arange(start, start + k.shape[0])
        slots = self.tables[seq, pos // self.bs].long() * self.bs + pos % self.bs
        rk.write_kv_cache(k, v, self.k, self.v, slots)


def _decode(q, k, v, cu, block_size, dtype, backend, seed=1):
    """Every sequence decoded token by token; each step batches all still-running sequences."""
    cache = PagedCache(block_size, dtype, seed, len(LENGTHS), max(LENGTHS))
    out = torch.empty_like(q)
    for t in range(max(LENGTHS)):
        live = [b for b, L in enumerate(LENGTHS) if t < L]
        rows = [int(cu[b]) + t for b in live]
        for b, r in zip(live, rows):
            cache.write(b, t, k[r:r + 1], v[r:r + 1])
        res = rk.attention_paged(q[rows], cache.k, cache.v, cache.tables[live], torch.tensor([t + 1] * len(live)),
                                 torch.arange(len(live) + 1), backend=backend)
        out[rows] = res
    return out


def _chunked(q, k, v, cu, block_size, dtype, seed):
    """Each sequence prefilled in random chunks; chunks of different sequences share calls."""
    rng = random.Random(seed)
    cache = PagedCache(block_size, dtype, seed, len(LENGTHS), max(LENGTHS))
    cuts = []
    for L in LENGTHS:
        pts = sorted(set(rng.sample(range(1, L), min(L - 1, 3)))) if L > 1 else []
        cuts.append([0] + pts + [L])
    out = torch.empty_like(q)
    for step in range(max(len(c) - 1 for c in cuts)):
        live = [b for b in range(len(LENGTHS)) if step < len(cuts[b]) - 1]
        rows, lens, qsl = [], [], [0]
        for b in live:
            lo, hi = cuts[b][step], cuts[b][step + 1]
            r0 = int(cu[b])
            cache.write(b, lo, k[r0 + lo:r0 + hi], v[r0 + lo:r0 + hi])
            rows += list(range(r0 + lo, r0 + hi))
            lens.append(hi)
            qsl.append(qsl[-1] + hi - lo)
        out[rows] = rk.attention_paged(q[rows], cache.k, cache.v, cache.tables[live], torch.tensor(lens), torch.tensor(qsl))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strict_prefill_equals_decode_and_chunked_prefill(dtype):
    q, k, v, cu = _qkv(dtype)
    prefill = rk.attention_varlen(q, k, v, cu)
    for block_size in (16, 5, 32):
        assert torch.equal(_decode(q, k, v, cu, block_size, dtype, "strict", seed=block_size), prefill), block_size
    for seed, block_size in ((0, 16), (1, 7), (2, 64)):
        assert torch.equal(_chunked(q, k, v, cu, block_size, dtype, seed), prefill), (seed, block_size)


def test_strict_sequence_alone_equals_packed():
    q, k, v, cu = _qkv(torch.bfloat16, seed=3)
    packed = rk.attention_varlen(q, k, v, cu)
    for b in range(len(LENGTHS)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        alone = rk.attention_varlen(q[lo:hi], k[lo:hi], v[lo:hi], torch.tensor([0, hi - lo]))
        assert torch.equal(alone, packed[lo:hi])
    native = rk.attention_varlen(q, k, v, cu, backend="native")  # negative control, recorded
    differ = sum(int((rk.attention_varlen(q[lo:hi], k[lo:hi], v[lo:hi], torch.tensor([0, hi - lo]), backend="native")
                      != native[lo:hi]).sum()) for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()))
    record_native("SDPA bf16, a sequence alone vs packed, values", differ)


def test_strict_attention_matches_sdpa_numerically():
    q, k, v, cu = _qkv(torch.float32, seed=4)
    assert (rk.attention_varlen(q, k, v, cu) - rk.attention_varlen(q, k, v, cu, backend="native")).abs().max() < 1e-5


def test_negative_control_native_decode_vs_prefill_recorded():
    q, k, v, cu = _qkv(torch.float32)
    prefill = rk.attention_varlen(q, k, v, cu, backend="native")
    decode = _decode(q, k, v, cu, 16, torch.float32, "native")
    assert (decode - prefill).abs().max() < 1e-5  # same function ...
    record_native("SDPA decode vs prefill values", int((decode != prefill).sum()))  # ... other bits (here)


def test_bad_inputs_raise():
    q, k, v, cu = _qkv(torch.float32)
    with pytest.raises(ValueError):
        rk.attention_varlen(q[:, :3], k, v, cu)  # 3 query heads cannot share 2 kv heads
    cache = PagedCache(16, torch.float32, 0, 1, 8)
    with pytest.raises(ValueError):
        rk.attention_paged(q[:5], cache.k, cache.v, cache.tables, torch.tensor([3]), torch.tensor([0, 5]))

"""Shared helpers for the invariance tests: build batches around one fixed row."""
from __future__ import annotations

import contextlib

import torch

BATCH_SIZES = (1, 2, 3, 7, 16, 64, 257)


def positions(m: int) -> tuple[int, ...]:
    return tuple(sorted({0, m // 2, m - 1}))


def row_failures(fn, row_inputs, make_inputs, sizes=BATCH_SIZES, seed=0):
    """Count (M, position) pairs where fn's output row differs from the row computed alone.

    row_inputs: tuple of tensors with a leading dim of 1 (the row under test).
    make_inputs(M, gen): tuple of tensors with leading dim M (other rows, random).
    """
    ref = fn(*row_inputs)[0]
    gen = torch.Generator().manual_seed(seed)
    bad = []
    for m in sizes:
        for pos in positions(m):
            args = [t.clone() for t in make_inputs(m, gen)]
            for a, r in zip(args, row_inputs):
                a[pos] = r[0]
            if not torch.equal(fn(*args)[pos], ref):
                bad.append((m, pos))
    return bad


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)

#!/usr/bin/env python3
"""Does a GEMM chain continued from a stored fp32 accumulator give the unbroken chain's bits? (issue 10's row-parallel
gap; benchmarks/H200_NOTES.md session 47: the K-chained row-parallel sum, a contract option not built.)

The GPU GEMM contract sums each output in wgmma k16 steps in K order into one fp32 accumulator, whatever the tile. If
that holds when the accumulator leaves the registers between two launches, a TP group could pass it rank to rank
over their K slices and get the TP = 1 plain GEMM's bits at every TP size, with no canonical segments. This probe
checks the claim, bit patterns only:
  * `one_launch`: this script's kernel over the whole K from +0.0 against the strict library GEMM in fp32 out
    (`gemm.matmul(..., out_dtype=float32)`, another tile): the tile-independence the contract already states;
  * `chained_T`: T launches, each over one K slice of its own contiguous weight shard (a TP rank's), each starting
    from the previous launch's stored fp32 accumulator, against the same library output; T = 2, 4, 8;
  * control `tree_T`: the slices started from +0.0 and summed left to right (what a chain is not): must differ.

    python3 scripts/gpu_chain_probe.py --out DIR      # a GPU: o / down / gate_up shapes at M = 64, 256, 4,096 in bf16
    TRITON_INTERPRET=1 python3 scripts/gpu_chain_probe.py --small --device cpu   # the index logic, exact sums (tests)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SHAPES = {"o": (4096, 4096), "down": (12288, 4096), "gate_up": (4096, 24576)}  # (K, N) at Qwen3-8B
SMALL = {"tiny": (256, 64)}


@triton.jit
def _chain_kernel(a_ptr, w_ptr, init_ptr, out_ptr, M, N, K, sam, swn, HAS_INIT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[M, N] fp32 = init (or +0.0) + a[M, K] @ w[N, K].T, K walked in BLOCK_K steps in order."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    cmask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_INIT:
        acc = tl.load(init_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], mask=cmask, other=0.0)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * sam + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * swn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc = tl.dot(a, w.T, acc)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=cmask)


def chain(a: torch.Tensor, w: torch.Tensor, init: torch.Tensor | None, block=(64, 64, 32)) -> torch.Tensor:
    M, K = a.shape
    N = w.shape[0]
    if w.shape[1] != K or not a.is_contiguous() or not w.is_contiguous():
        raise ValueError(f"chain: a {tuple(a.shape)} and w {tuple(w.shape)} must be contiguous [M, K] and [N, K]")
    out = torch.empty(M, N, dtype=torch.float32, device=a.device)
    bm, bn, bk = block
    if K % bk:
        raise ValueError(f"chain: K={K} must be a multiple of BLOCK_K={bk} (a slice boundary inside a step)")
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _chain_kernel[grid](a, w, init if init is not None else out, out, M, N, K, a.stride(0), w.stride(0),
                        HAS_INIT=init is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return out


def slices(a: torch.Tensor, w: torch.Tensor, t: int):
    """T ranks' inputs: a's and w's K slices, each made contiguous (a rank holds only its shard)."""
    K = a.shape[1]
    if K % t:
        raise ValueError(f"K={K} is not divisible by T={t}")
    s = K // t
    return [(a[:, r * s:(r + 1) * s].contiguous(), w[:, r * s:(r + 1) * s].contiguous()) for r in range(t)]


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))


def probe(name: str, K: int, N: int, M: int, dtype, device, block, reference, exact: bool = False) -> dict:
    """exact: small integers, so every order gives the same sums (the interpreter's index check; no control)."""
    g = torch.Generator(device="cpu").manual_seed(K * 7 + N * 3 + M)
    if exact:
        a = torch.randint(-3, 4, (M, K), generator=g).to(dtype).to(device)
        w = torch.randint(-3, 4, (N, K), generator=g).to(dtype).to(device)
    else:
        a = torch.randn(M, K, generator=g).to(dtype).to(device)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(device)
    ref = reference(a, w)
    row = {"gemm": name, "M": M, "K": K, "N": N, "one_launch": same_bits(chain(a, w, None, block), ref)}
    for t in (2, 4, 8):
        parts = slices(a, w, t)
        acc = None
        for ar, wr in parts:
            acc = chain(ar, wr, acc, block)
        row[f"chained_{t}"] = same_bits(acc, ref)
        if exact:
            continue
        tree = None
        for ar, wr in parts:
            p = chain(ar, wr, None, block)
            tree = p if tree is None else tree + p
        row[f"tree_{t}_differs"] = not same_bits(tree, ref)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes, exact integer sums (the interpreter's test)")
    ap.add_argument("--ms", default="64,256,4096")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.small:  # under the interpreter tl.dot is numpy's: exact integer sums check the slicing and the masks
        def reference(a, w):
            return (a.double() @ w.double().T).float()
        shapes, ms, dtype, block = SMALL, [5, 33], torch.float32, (16, 16, 16)
    else:
        from rlkernel.backends.triton import gemm

        def reference(a, w):
            return gemm.matmul(a, w, out_dtype=torch.float32)
        shapes, ms, dtype, block = SHAPES, [int(m) for m in args.ms.split(",")], torch.bfloat16, (128, 128, 64)
    rows = [probe(name, K, N, M, dtype, device, block, reference, exact=args.small) for name, (K, N) in shapes.items()
            for M in ms]
    checks = [k for k in rows[0] if k.startswith(("one_launch", "chained_", "tree_"))]
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype), "block": block,
              "rows": rows, "all": {k: all(r[k] for r in rows) for k in checks}}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "chain_probe.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0 if all(report["all"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Probe (Triton >= 3.8, a GPU): which Gluon cluster primitive gemm_cluster's launch failure comes from — a 2-CTA
multicast TMA copy; a cross-CTA mbarrier arrive / lead wait; the same two inside warp_specialize. One case per
process (a fault poisons the context): python3 scripts/gpu_cluster_probe.py CASE."""
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def mc_copy(in_desc, out_desc):
    smem = gl.allocate_shared_memory(in_desc.dtype, in_desc.block_type.shape, in_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [2], mbarrier.MBarrierLayout([[1]]))
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, in_desc.nbytes_per_cta)
    tma.async_load(in_desc, [0, 0], bar, smem, multicast=True)
    mbarrier.wait(bar, 0)
    tma.async_copy_shared_to_global(out_desc, [0, 0], smem)
    tma.store_wait(0)


@gluon.jit
def _arr(bar, n):
    for i in range(n):
        mbarrier.arrive(bar.index(i % 2), count=1)


@gluon.jit
def _wt(bar, n):
    for i in range(n):
        mbarrier.wait(bar.index(i % 2), (i // 2) & 1)


@gluon.jit
def xcta_bar(out_ptr, n, WS: gl.constexpr):
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout([[0]]))
    for i in gl.static_range(2):
        mbarrier.init(bar.index(i), count=1)
    if WS:
        gl.warp_specialize([(_wt, (bar, n)), (_arr, (bar, n))], [1], [40])
    else:
        _arr(bar, n)
        _wt(bar, n)


def main():
    case = sys.argv[1]
    if case == "mc_copy":
        x = torch.randn(128, 64, device="cuda").to(torch.bfloat16)
        out = torch.zeros_like(x)
        lay = gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16, cga_layout=[[0, 0]])
        d = TensorDescriptor(x, [128, 64], [64, 1], [128, 64], lay)
        od = TensorDescriptor(out, [128, 64], [64, 1], [128, 64], lay)
        mc_copy[(1,)](d, od, num_warps=4, num_ctas=2)
        torch.cuda.synchronize()
        print(case, "equal", bool(torch.equal(out, x)))
    else:
        out = torch.zeros(4, device="cuda")
        xcta_bar[(1,)](out, 64, case == "xcta_ws", num_warps=4, num_ctas=2)
        torch.cuda.synchronize()
        print(case, "ok")


if __name__ == "__main__":
    main()

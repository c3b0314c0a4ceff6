#!/usr/bin/env python3
"""One launch of each kernel that caps issue 10's last ratios, for Nsight Compute's hardware counters (session 33).

What it asks of the counters: is a kernel bound by shared memory's bandwidth (wgmma reads its operands from shared
memory; TMA writes the stages there), by the tensor pipe, by the MUFU (exp2) pipe, or by issue / dependencies?
- the Gluon attention prefill (8 x 4,096 tokens, 32 / 8 heads, D 128) as shipped and with its variants (the query tile
  from registers: `qreg`; q.k^T issued before p.v: `qk_first`), and SDPA on the same inputs;
- the row-parallel GEMM o (K = N = 4,096) at M = 4,096: the library's segmented tile (seg4_128x128_p), the same tile
  unsegmented (128x128_p), the 128 x 256 tile unsegmented (128x256_p) and cuBLAS.

Every kernel is launched once outside the profiled range first (compiles, first-use checks), then once inside
`cudaProfilerStart` / `cudaProfilerStop`, in the order printed. Run under ncu:

    ncu --clock-control none --profile-from-start off --set full -o $OUT/probe python3 scripts/gpu_ncu_probe.py

(`gpu_session.py ncu_probe` does that and writes the details page as text.) Without ncu it runs each launch once.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return 0
    import gpu_gluon_attn as GA
    from rlkernel.backends.triton import attention_gluon as AG
    from rlkernel.backends.triton import gemm_gluon as GG

    L = 4096
    q, k, v, cu, (qb, kb, vb) = GA.packed_inputs(8, L)
    M, K, N = 4096, 4096, 4096
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    tiles = {t.name: t for t in (GG.SEG_128x128, GG.Tile("128x128_p", 128, 128, 0, 4, 1, 8, persistent=True, group_m=8),
                                 GG.Tile("128x256_p", 128, 128, 128, 4, 1, 8, persistent=True, group_m=8))}
    targets = {}
    for var in ("production", "qreg", "qk_first", "qreg_qk_first"):
        targets[f"attn_{var}"] = lambda var=var: AG.launch(*GA.direct_args(q, k, v, cu, L), **GA.VARIANTS[var])
    targets["attn_sdpa"] = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    for name, t in tiles.items():
        targets[f"gemm_o_{name}"] = lambda t=t: GG.launch(a, w, t)
    targets["gemm_o_cublas"] = lambda: F.linear(a, w)
    for fn in targets.values():  # compiles and first-use checks outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for i, (name, fn) in enumerate(targets.items()):
        print(f"profiled launch {i}: {name}", flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

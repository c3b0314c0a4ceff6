"""Implementations of rlkernel's contracts, registered with `rlkernel.dispatch` on import.

| folder | implements | runs on |
|---|---|---|
| `reference/` | the strict contracts as a torch composition: the executable spec, with the explicit backwards every implementation shares | any device |
| `cpu/` | the strict contracts as C++ kernels (same bits as `reference`, checked at load) | CPU |
| `native.py` | the native contracts: torch's production ops (the "P" side of every ablation) | any device |
| `triton/` | GPU kernels under their own GPU contracts | CUDA |
| `fa3.py` | attention by vLLM's FlashAttention 3, one KV split, checked at load (opt-in: `ops={"attention": "fa3"}`) | CUDA |
"""
from . import cpu, fa3, native, reference, triton  # noqa: F401  (registration)

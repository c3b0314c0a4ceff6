"""A strict RMSNorm kernel that keeps its contract at one thread and breaks it at more (for `vime doctor --plugin`).

The failure that started the CPU-order issue, in miniature: a vendor GEMM whose threading chose the order inside our
tiles gave the contract's bits at 1 thread and other bits at 2, so a rollout at 1 thread (vLLM pins its process) and a
trainer at 2 disagreed while `contracts_match` said true. Importing this module re-registers the "cpu" implementation
of rms_norm: the real kernel at 1 thread, torch's reduction order (not the contract's tree) at more."""
import torch

from rlkernel import dispatch

_real = dispatch._REGISTRY[("rms_norm", "cpu")]


@dispatch.register("rms_norm", "cpu", _real.contract, devices=_real.devices, available=_real.available, prims=_real.prims)
def rms_norm(x, weight, eps, residual=None):
    if torch.get_num_threads() == 1:
        return _real.fn(x, weight, eps, residual)
    h = x if residual is None else x + residual
    var = h.float().pow(2).mean(-1, keepdim=True)  # torch's order, not the contract's
    y = (h.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight
    return y if residual is None else (y, h)

"""A deliberately different kernel for the strict RMSNorm contract (for `vime diagnose --plugin`).

It claims the strict contract but reduces the sum of squares in torch's order instead of the
contract's balanced tree: the kind of implementation bug (or vendor-library substitution)
that `contracts_match` cannot see and the golden bits and `vime diagnose` must name.
Importing this module registers it as implementation "variant" of rms_norm."""
import torch

from rlkernel import dispatch
from rlkernel.contracts import norm as c_norm


@dispatch.register("rms_norm", "variant", c_norm.STRICT, devices=("cpu",))
def rms_norm(x, weight, eps, residual=None):
    h = x if residual is None else x + residual
    var = h.float().pow(2).mean(-1, keepdim=True)  # torch's reduction order, not the contract's tree
    y = (h.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight
    return y if residual is None else (y, h)

"""Shared fixtures.

`impl`: the strict contracts have two CPU implementations that must give the same bits: the
C++ kernels ("cpu", rlkernel/backends/cpu) and the torch composition ("reference",
rlkernel/backends/reference). Invariance and determinism modules opt in with
`pytestmark = pytest.mark.usefixtures("impl")`, so each of their tests runs once per
implementation, pinned with `rlkernel.mode(impl=...)`.
"""
import pytest

import rlkernel as rk
from rlkernel.backends import cpu


@pytest.fixture(params=["cpu", "reference"])
def impl(request):
    if request.param == "cpu" and not cpu.available():
        pytest.fail(f"the CPU kernels did not load: {cpu.status()['error']}")
    with rk.mode("strict", impl=request.param):
        yield request.param

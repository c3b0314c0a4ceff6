"""Shared fixtures.

`impl`: the strict contracts have two CPU implementations that must give the same bits: the
C++ kernels ("cpu", rlkernel/backends/cpu) and the torch composition ("reference",
rlkernel/backends/reference). Invariance and determinism modules opt in with
`pytestmark = pytest.mark.usefixtures("impl")`, so each of their tests runs once per
implementation, pinned with `rlkernel.mode(impl=...)`.
"""
import os

import pytest
import torch

import rlkernel as rk
from rlkernel.backends import cpu

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers (pytest-xdist) on CI's two cores: each worker's in-process torch ops on one thread,
    # or two OpenMP teams of two busy-wait on two cores (session 23: the reference batch-invariance tests ran 3-5x
    # slower that way). Tests about thread counts set their own (helpers.threads); subprocesses pick their own.
    torch.set_num_threads(1)


@pytest.fixture(params=["cpu", "reference"])
def impl(request):
    if request.param == "cpu" and not cpu.available():
        pytest.fail(f"the CPU kernels did not load: {cpu.status()['error']}")
    with rk.mode("strict", impl=request.param):
        yield request.param

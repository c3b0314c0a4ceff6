"""Shared fixtures.

`impl`: the strict reference contract has two CPU implementations that must give the same
bits (rlkernel/fused.py): the fused C++ kernels and the torch composition. Invariance and
determinism modules opt in with `pytestmark = pytest.mark.usefixtures("impl")`, so each
of their tests runs once per implementation.
"""
import contextlib

import pytest

from rlkernel import fused


@pytest.fixture(params=["fused", "composition"])
def impl(request):
    if request.param == "fused" and not fused.available():
        pytest.fail(f"the fused CPU kernels did not load: {fused.status()['error']}")
    ctx = fused.disabled() if request.param == "composition" else contextlib.nullcontext()
    with ctx:
        yield request.param

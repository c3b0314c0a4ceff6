"""Claims on a CUDA device (skipped without one — CI has none): the strict reference backend
keeps batch invariance and prefill == paged decode on the GPU, forward and backward are
run-to-run deterministic, and the native path on the same inputs differs (negative control)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_gpu_strict_batch_invariance_and_native_control():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_checks

    with torch.no_grad():
        inv = gpu_checks.batch_invariance()
        att = gpu_checks.prefill_vs_decode()
    assert all(v["strict_mismatch"] == 0 for v in inv.values()) and att["strict_mismatch"] == 0
    assert inv["linear"]["native_mismatch"] > 0 and att["native_mismatch"] > 0
    assert gpu_checks.determinism()

"""The GPU golden-bits file (rlkernel/contracts/gpu_golden.json) and the Triton backend's first-use check, on the CPU.

The hashes of a GPU architecture can only be recorded and checked on that GPU (`python -m rlkernel.golden --record-gpu`,
`gpu_session.py gpu_golden`). Here the same code runs with the CPU implementation under a made-up architecture key in a
temporary file: what it records equals the committed CPU golden hashes (the suite's own reference), a changed hash is
named, a re-record that would change bits under the same contracts is refused; and the backend's check policy
(check / warn / off, its recursion while the cases run) with the check's verdict forced, since no GPU is here."""
from __future__ import annotations

import json

import pytest

from rlkernel import golden
from rlkernel.backends import triton as T


def test_recording_and_checking_an_architecture(tmp_path):
    path = tmp_path / "gpu_golden.json"
    kw = dict(arch="sm_test", path=path, impl="cpu", device="cpu")
    assert golden.gpu_self_check(**kw).startswith("unverified: no golden bits committed for sm_test")
    entry = golden.record_gpu(**kw)
    committed = golden.committed()["cases"]
    assert entry["cases"] == committed  # the CPU implementation's bits are the CPU golden ones: the record path adds nothing
    assert entry["contracts"] == golden.gpu_contract_ids() and json.loads(path.read_text())["sm_test"] == entry
    slice_n = sum(c.slice for c in golden._cases())
    assert golden.gpu_self_check(**kw) == f"{slice_n} golden cases reproduced (sm_test)"

    data = json.loads(path.read_text())
    data["sm_test"]["cases"]["rms_norm_bf16"] = "0" * 24  # a slice case whose recorded bits differ
    path.write_text(json.dumps(data))
    entry2, bad = golden.check_gpu(arch="sm_test", path=path, impl="cpu", device="cpu")
    assert entry2 is not None and len(bad) == 1 and bad[0].startswith("rms_norm_bf16 (000000")
    with pytest.raises(golden.GoldenMismatch, match="rms_norm_bf16"):
        golden.gpu_self_check(**kw)
    by_op = golden.check_gpu_by_op(["rms_norm", "linear"], **kw)
    assert by_op == {"rms_norm": ["rms_norm_bf16"], "linear": []}  # what `vime doctor` prints for a GPU engine
    assert golden.check_gpu_by_op(["linear"], **{**kw, "arch": "sm_none"}) == {"linear": None}
    with pytest.raises(SystemExit, match=r"refused: on sm_test the bits of \['rms_norm'\]"):
        golden.record_gpu(**kw)  # same contracts, other bits: not silently replaced
    assert golden.record_gpu(force=True, **kw)["cases"]["rms_norm_bf16"] == committed["rms_norm_bf16"]

    # a newer rms_norm contract: its recorded bits are stale, not compared (and not a refusal), and say so
    data = json.loads(path.read_text())
    data["sm_test"]["contracts"]["rms_norm"] = "rms_norm/older"
    data["sm_test"]["cases"]["rms_norm_bf16"] = "0" * 24
    path.write_text(json.dumps(data))
    assert golden.check_gpu(arch="sm_test", path=path, impl="cpu", device="cpu")[1] == []
    verdict = golden.gpu_self_check(**kw)
    assert verdict == f"{slice_n - 2} golden cases reproduced (sm_test); unverified (contract changed since recorded): rms_norm"
    assert golden.record_gpu(**kw)["contracts"]["rms_norm"] == golden.gpu_contract_ids()["rms_norm"]  # re-record allowed


def test_a_case_that_raises_is_recorded_not_fatal():
    got = golden.compute("no-such-impl", only_slice=True, record_errors=True)
    assert got and set(got.values()) == {"!BackendUnavailable"}
    with pytest.raises(Exception, match="no-such-impl"):
        golden.compute("no-such-impl", only_slice=True)


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(T, "_GOLDEN", {"result": None, "failed": None, "seconds": None})
    return T._GOLDEN


def test_the_backend_check_policy(fresh_state, monkeypatch):
    calls = []

    def verdict_ok():
        calls.append(1)
        assert T._golden_ok()  # the cases resolve the backend again while the check runs: no recursion
        return "12 golden cases reproduced (sm_90)"

    monkeypatch.setattr(golden, "gpu_self_check", verdict_ok)
    assert T._golden_ok() and T._golden_ok() and len(calls) == 1  # once per process
    assert T.status()["golden"] == "12 golden cases reproduced (sm_90)"
    assert isinstance(T.status()["golden_seconds"], float)  # what the start-up spent on it, in provenance

    def verdict_differs():
        raise golden.GoldenMismatch("the GPU kernels on sm_90 differ ... in: linear_bf16")

    monkeypatch.setattr(golden, "gpu_self_check", verdict_differs)
    for mode in ("check", "warn", "off"):
        monkeypatch.setattr(T, "_GOLDEN", {"result": None, "failed": None, "seconds": None})
        monkeypatch.setenv(T.GOLDEN_ENV, mode)
        if mode == "check":
            for _ in range(2):  # refused at the first use and at every later one
                with pytest.raises(T.GoldenCheckError, match="linear_bf16.*RLKERNEL_GPU_GOLDEN=warn"):
                    T._golden_ok()
            with pytest.raises(T.GoldenCheckError):  # also where the dispatcher asks: never a quiet False
                T.available()
            assert "linear_bf16" in T.unavailable_reason()
        elif mode == "warn":
            with pytest.warns(RuntimeWarning, match="linear_bf16"):
                assert T._golden_ok()
            assert T.status()["golden"].startswith("differs (warn)")
        else:
            assert T._golden_ok() and T.status() == {"golden": "off (RLKERNEL_GPU_GOLDEN=off)", "golden_seconds": None,
                                                      T.GOLDEN_ENV: "off", "unavailable": T.unavailable_reason(),
                                                      "attention_prefill_gluon": T._gluon("attention_gluon"),
                                                      "gemm_gluon": T._gluon("gemm_gluon")}
    monkeypatch.setenv(T.GOLDEN_ENV, "sometimes")
    monkeypatch.setattr(T, "_GOLDEN", {"result": None, "failed": None, "seconds": None})
    with pytest.raises(ValueError, match="check, warn or off"):
        T._golden_ok()


def test_without_cuda_the_backend_is_unavailable_and_checks_nothing(fresh_state, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.setattr(golden, "gpu_self_check", lambda: pytest.fail("the check ran without a GPU"))
    assert T.available() is False and fresh_state["result"] is None

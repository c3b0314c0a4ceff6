"""scripts/gpu_strict_parity.py's `targets`: issue 10's verdicts read off a harness result (written with every run).

Synthetic results, so each rule is seen to fail: a GEMM row below 0.90 at M >= 256 is named and fails the target,
the chained timer is read where a row has one, rows below M = 256 and the 4-segment rows are reported but not
counted, a missing section reads None (not measured) rather than met, and the parity needs a native mismatch."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import gpu_strict_parity as P  # noqa: E402


def _result(**over):
    gemm = {
        "qkv_M16": {"ratio_tflops": 0.40},  # below M = 256: not counted
        "qkv_M256": {"ratio_tflops": 0.50, "ratio_chain": 0.93},  # the chained timer is read
        "o_M4096": {"ratio_tflops": 0.99, "segments4_warpspec_ratio": 0.80},  # 4 segments: beside, not counted
        "down_M16384": {"ratio_tflops": 0.96, "segments4_warpspec_ratio": 0.86},
    }
    res = {"timing": {"gemm": gemm, "attention_prefill_8x4096": {"ratio": 0.89},
                      "decode_step_b64_ctx2048": {"ratio_latency": 1.03},
                      "decode_step_b64_ctx2048_cuda_graphs": {"ratio_latency": 0.91},
                      "scoring_forward_8x2048": {"ratio_time": 0.84}},
           "train": {"ratio_time": 1.2},
           "parity": {"compared_tokens": 1_123_092, "mismatch_count": 0, "rollout_hash": "ab", "training_hash": "ab"},
           "native": {"mismatch_count": 6235}}
    res.update(over)
    return res


def test_every_target_met():
    t = P.targets(_result())
    g = t["gemm_vs_cublas_m_ge_256"]
    assert g["met"] is True and g["below"] == [] and g["min"] == 0.93
    assert set(g["rows"]) == {"qkv_M256", "o_M4096", "down_M16384"} and g["rows"]["qkv_M256"]["timer"] == "ratio_chain"
    assert g["row_parallel_4_segments"]["rows"] == {"o_M4096": 0.80, "down_M16384": 0.86}
    assert all(t[k]["met"] is True for k in ("attention_prefill_vs_sdpa", "decode_step_b64_latency_cuda_graphs",
                                             "decode_step_b64_latency_eager", "scoring_forward_time",
                                             "forward_backward_time", "parity"))


def test_each_target_can_fail():
    res = _result()
    res["timing"]["gemm"]["gate_up_M256"] = {"ratio_tflops": 0.95, "ratio_chain": 0.89}
    res["timing"]["attention_prefill_8x4096"]["ratio"] = 0.84
    res["timing"]["decode_step_b64_ctx2048_cuda_graphs"]["ratio_latency"] = 1.31
    res["timing"]["scoring_forward_8x2048"]["ratio_time"] = 1.16
    res["train"]["ratio_time"] = 1.51
    t = P.targets(res)
    assert t["gemm_vs_cublas_m_ge_256"]["met"] is False and t["gemm_vs_cublas_m_ge_256"]["below"] == ["gate_up_M256"]
    for k in ("attention_prefill_vs_sdpa", "decode_step_b64_latency_cuda_graphs", "scoring_forward_time",
              "forward_backward_time"):
        assert t[k]["met"] is False, k
    for par, nat in (({"mismatch_count": 1}, {}), ({"compared_tokens": 999_999}, {}), ({"training_hash": "cd"}, {}),
                     ({}, {"mismatch_count": 0})):
        r = _result()
        r["parity"].update(par)
        r["native"].update(nat)
        assert P.targets(r)["parity"]["met"] is False, (par, nat)


def test_what_was_not_measured_is_none_not_met():
    t = P.targets({"parity": {}})
    assert t["gemm_vs_cublas_m_ge_256"]["met"] is None and t["gemm_vs_cublas_m_ge_256"]["min"] is None
    assert t["attention_prefill_vs_sdpa"] == {"value": None, "bound": 0.85, "met": None}
    assert t["parity"]["met"] is None and t["forward_backward_time"]["met"] is None

"""Claims about selection, contracts and provenance: no mode means strict; modes nest and
are restored on exceptions; per-op overrides apply to that op only; strict never falls
back silently; ΔC between strict and native names the differing fields; provenance
records every call."""
import threading

import pytest
import torch

import rlkernel as rk
from rlkernel import dispatch


def test_default_is_strict_on_the_cpu_kernels():
    assert rk.current_policy().mode == "strict"
    assert rk.contract_for("linear").backend == "strict"
    assert dispatch.resolve("linear", torch.device("cpu")).name == "cpu"
    with rk.mode(impl="reference"):  # pinning the composition: the same contract
        assert dispatch.resolve("linear", torch.device("cpu")).name == "reference"
        assert rk.contract_for("linear") == rk.contract_for("linear", "cpu")
        with rk.mode("strict"):  # an inner block keeps the pin
            assert dispatch.resolve("linear", torch.device("cpu")).name == "reference"


def test_modes_nest_and_restore_after_exceptions():
    with rk.mode("native"):
        assert rk.contract_for("attention").backend == "native"
        with pytest.raises(KeyError):
            with rk.mode("strict", ops={"attention": "native"}):
                assert rk.contract_for("attention").backend == "native"
                assert rk.contract_for("linear").backend == "strict"
                raise KeyError("boom")
        assert rk.current_policy().mode == "native"
    assert rk.current_policy() == rk.ExecutionPolicy()


def test_mode_does_not_leak_into_other_threads():
    seen = []
    with rk.mode("native"):
        t = threading.Thread(target=lambda: seen.append(rk.current_policy().mode))
        t.start()
        t.join()
    assert seen == ["strict"]


def test_strict_never_falls_back():
    x = torch.randn(2, 4)
    with pytest.raises(rk.BackendUnavailable):
        rk.linear(x, torch.randn(3, 4), backend="triton")
    with rk.mode("strict", impl="triton"):
        with pytest.raises(rk.BackendUnavailable):
            rk.rms_norm(x, torch.ones(4))


def test_bad_policy_is_rejected():
    with pytest.raises(ValueError):
        rk.ExecutionPolicy(mode="fast")
    with pytest.raises(ValueError):
        rk.ExecutionPolicy(ops={"softmax": "native"})


def test_contract_diff_predicts_where_strict_and_native_differ():
    for op in rk.OPS:
        s, n = rk.contract_for(op, "reference"), rk.contract_for(op, "native")
        fields = {d.field for d in rk.diff(s, n)}
        assert fields, op
        assert rk.diff(s, s) == []
        assert s.contract_id != n.contract_id
    lin = {d.field for d in rk.diff(rk.contract_for("linear", "reference"), rk.contract_for("linear", "native"))}
    assert {"partition", "merge"} <= lin
    with pytest.raises(ValueError):
        rk.diff(rk.contract_for("linear"), rk.contract_for("rms_norm"))


def test_contract_id_is_stable_and_field_sensitive():
    a = rk.Contract(op="x", backend="reference", domain="K", partition=(("tile", 16),))
    b = rk.Contract(op="x", backend="reference", domain="K", partition=(("tile", 32),))
    assert a.contract_id == rk.Contract(op="x", backend="reference", domain="K", partition=(("tile", 16),)).contract_id
    assert a.contract_id != b.contract_id
    assert [d.field for d in rk.diff(a, b)] == ["partition"]


def test_provenance_records_each_call():
    x = torch.randn(5, 8)
    with rk.record_provenance() as recs:
        rk.linear(x, torch.randn(3, 8))
        with rk.mode("native"):
            rk.rms_norm(x, torch.ones(8))
    assert [(r.op, r.backend, r.impl) for r in recs] == [("linear", "strict", "cpu"), ("rms_norm", "native", "native")]
    assert recs[0].shapes == ((5, 8), (3, 8)) and recs[0].device == "cpu" and recs[0].threads >= 1
    assert recs[0].contract_id == rk.contract_for("linear").contract_id
    with rk.record_provenance() as outer:
        with rk.record_provenance() as inner:
            rk.linear(x, torch.randn(3, 8))
    assert len(inner) == 1 and outer == inner  # nested collectors all see the call


def test_registry_rejects_mismatched_contracts():
    c = rk.Contract(op="rms_norm", backend="other", domain="K")
    with pytest.raises(ValueError):
        dispatch.register("linear", "reference2", c)
    with pytest.raises(ValueError):
        dispatch.register("softmax", "other", c)


def test_provenance_counter_and_contract_match():
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    a, b = rk.ProvenanceCounter(), rk.ProvenanceCounter()
    with a.collect():
        rk.linear(x, w)
        rk.linear(x, w)
    with b.collect(), rk.mode("native"):
        rk.linear(x, w)
    sa, sb = a.take(), b.take()
    assert [(e["backend"], e["impl"], e["calls"]) for e in sa["linear"]] == [("strict", "cpu", 2)] and a.take() == {}
    assert rk.contracts_match(sa, sa) == (True, []) and rk.contracts_match(sa, sb) == (False, ["linear"])


def test_a_fallback_is_judged_per_op_and_device():
    """Every op has a Triton kernel, its first strict choice on CUDA (rope since session 8: before, its reference
    composition was the first choice there and was not a fallback); an op on the reference composition there is one."""
    from rlkernel.dispatch import first_strict
    from vime.strictness import strict_status

    assert all(first_strict(op, "cuda") == "triton" for op in rk.OPS)
    assert all(first_strict(op, "cpu") == "cpu" for op in rk.OPS)

    def entry(impl):
        return [{"backend": "strict", "impl": impl, "contract_id": "x", "device": "cuda", "calls": 1}]

    ok = strict_status("strict", {}, {"rollout": {"rope": entry("triton"), "linear": entry("triton")}, "trainer": {}})
    assert ok == {"strict_ok": True, "strict_violations": []}
    bad = strict_status("strict", {}, {"rollout": {"rope": entry("reference")}, "trainer": {}})
    assert bad["strict_ok"] is False and bad["strict_violations"] == ["rollout ran rope on 'reference': a fallback from 'triton' on cuda"]


def test_native_packed_attention_off_cuda_is_sdpa_per_request():
    """The native op takes torch's varlen flash attention only on CUDA in half precision; on the CPU it returns None and
    the per-request SDPA composition runs (its result is the op's, bit for bit: the same function)."""
    from rlkernel.backends import native

    torch.manual_seed(0)
    q, k, v = torch.randn(12, 4, 8, dtype=torch.bfloat16), torch.randn(12, 2, 8, dtype=torch.bfloat16), torch.randn(12, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 12])
    assert native.flash_varlen(q, k, v, cu, 8 ** -0.5) is None
    with rk.mode("native"):
        out = rk.attention_varlen(q, k, v, cu)
    assert torch.equal(out, native.varlen(native._sdpa, q, k, v, cu, 8 ** -0.5))
    api = native._varlen_api()  # a record of this torch's API shape, not a claim
    print("torch varlen_attn:", None if api is None else sorted(api[1] & {"is_causal", "window_size", "enable_gqa", "scale"}))


def test_a_gpu_contract_on_another_architecture_is_another_contract():
    """The GPU contracts are declared for sm_90 (wgmma k16 chains; golden bits recorded there). On another architecture
    the same kernels lower to other instructions (sm_80 mma.sync, sm_100 tcgen05: scripts/arch_compile_check.py), so a
    call there is recorded under `on_arch` of its contract: another id, a ΔC in the partition's arch, the family
    renamed — a rollout on one GPU kind and a trainer on another are told apart by contracts_match, and `vime
    diagnose` names it a contract cause. On sm_90 and for the CPU contracts nothing changes."""
    from rlkernel.contracts import gpu as G
    from rlkernel.contracts.base import declared_arch, on_arch
    from vime import diagnose as D

    lin, fa3 = G.BY_OP["linear"], G.FA3_ATTENTION
    assert declared_arch(lin) == "sm_90" and declared_arch(rk.contract_for("linear")) is None
    assert on_arch(lin, "sm_90") is lin and on_arch(rk.contract_for("linear"), "sm_80") is rk.contract_for("linear")
    a80, a100 = on_arch(lin, "sm_80"), on_arch(lin, "sm_100")
    assert a80 is on_arch(lin, "sm_80")  # made once
    assert len({lin.contract_id, a80.contract_id, a100.contract_id}) == 3
    assert (a80.backend, a100.backend, on_arch(fa3, "sm_80").backend) == ("triton-sm80", "triton-sm100", "fa3-sm80")
    assert [d.field for d in rk.diff(lin, a80)] == ["partition"] and dict(a80.partition)["arch"] == "sm_80"
    assert dispatch.effective_contract(lin, torch.device("cpu")) is lin  # only a CUDA device has an architecture

    def seen(c):
        return {"linear": [{"backend": c.backend, "impl": "cpu", "contract_id": c.contract_id, "device": "cpu",
                            "calls": 1}]}

    assert rk.contracts_match(seen(lin), seen(lin)) == (True, [])
    assert rk.contracts_match(seen(lin), seen(a80)) == (False, ["linear"])
    # diagnose: both sides resolve (here, on the CPU) to one contract, yet ran under two ids -> a contract cause
    site = D.SiteDiff(site="0.qkv", layer=0, name="qkv", op="linear", rows=4, out_differ=4, in_differ=0, max_abs=1.0)
    sides = {s: D.Side(mode="strict") for s in D.SIDES}
    why = D.explain(site, sides, {"rollout": seen(lin), "trainer": seen(a80)})
    assert why["cause"] == "contract" and "another architecture" in why["detail"], why
    same = D.explain(site, sides, {"rollout": seen(lin), "trainer": seen(lin)})
    assert same["cause"] != "contract", same  # the control: one id on both sides is not a contract cause


def test_a_tap_sees_the_kernels_an_implementation_names_and_nothing_is_built_without_one():
    """rlkernel.dispatch.note_kernel / kernel_notes (what `vime diagnose` lists per side for the op that diverged):
    the CPU GEMM names its packed-weight path, and a note's text is built only while a tap observes."""
    x, w = torch.randn(5, 64), torch.randn(32, 64)
    rk.linear(x, w)  # the CPU kernels loaded (and golden-checked) before the tap
    seen, built = [], []
    with rk.dispatch.tap(lambda op, impl, tensors, out: seen.append((op, rk.dispatch.kernel_notes()))):
        rk.linear(x, w)
        with rk.mode("strict", pack_weights=True):
            rk.linear(x, w)
        with rk.mode("native"):
            rk.linear(x, w)
    assert seen == [("linear", ("cpu gemm",)), ("linear", ("cpu gemm, packed weight",)), ("linear", ())], seen
    assert rk.dispatch.kernel_notes() == ()  # outside a tap's callback: nothing
    rk.dispatch.note_kernel(lambda: built.append(1) or "x")  # no tap observes: never built
    assert built == []

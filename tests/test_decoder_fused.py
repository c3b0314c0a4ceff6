"""Claims: `StrictDecoder.fuse_projections()` (the rollout engine's layout: q/k/v and gate/up each one GEMM over one
weight whose rows the separate parameters view) gives the separate GEMMs' bits, for Qwen3 and Llama, fp32 and bf16,
packed scoring and the logprobs; parameter names, shapes and values stay; weights loaded in place afterwards reach the
fused GEMM; a call that wants gradients, or a parameter moved off the fused storage, runs the separate GEMMs (and still
gets the bits). The layout's other fusions (gate/up + swiglu as `rk.linear_swiglu`, each residual add inside the norm
that reads the sum) are inside the same bit comparison, and a hook on a norm or a layer turns the latter off there. The native path's fused vs separate GEMMs are recorded, not asserted (MKL/oneDNN may or may not split a
wider GEMM differently on this CPU)."""
import copy

import pytest
import torch

import rlkernel as rk
from helpers import record_native
from rlkernel.models import StrictDecoder
from vime.tiny_model import make_tiny_checkpoint

CASES = {
    "qwen3": dict(arch="qwen3", tie_word_embeddings=False, vocab_size=131, hidden_size=72, intermediate_size=136,
                  num_heads=6, num_kv_heads=2, head_dim=12),
    "llama": dict(arch="llama", tie_word_embeddings=True, vocab_size=127, hidden_size=48, intermediate_size=100,
                  num_heads=3, num_kv_heads=1, head_dim=16, num_layers=3),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), seed=5, init_std=0.08, **CASES[request.param])


def _seqs(vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (2, 9, 33, 70)]


def _run(m, seqs):
    with torch.no_grad():
        return m.score(seqs, temperature=0.9), m.forward_packed(torch.tensor(seqs[-1]), torch.tensor([0, len(seqs[-1])]))


def _calls(m, seqs) -> int:
    """linear calls of one packed forward, by the op provenance"""
    counter = rk.ProvenanceCounter()
    with counter.collect(), torch.no_grad():
        m.forward_packed(torch.tensor(seqs[0]), torch.tensor([0, len(seqs[0])]))
    return sum(e["calls"] for e in counter.take().get("linear", []))


def _norms_with_residual(m, seqs) -> int:
    """rms_norm calls of one packed forward that took a residual (their output is the pair (normed, x + residual))"""
    seen = []
    with rk.dispatch.tap(lambda op, impl, tensors, out: seen.append(op == "rms_norm" and isinstance(out, tuple))), \
            torch.no_grad():
        m.forward_packed(torch.tensor(seqs[0]), torch.tensor([0, len(seqs[0])]))
    return sum(seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projections_give_the_separate_bits(checkpoint, dtype):
    sep = StrictDecoder.from_pretrained(checkpoint, dtype=dtype)
    fused = copy.deepcopy(sep)
    layers = sep.config.num_layers
    assert fused.fuse_projections() == 2 * layers and fused.fuse_projections() == 2 * layers  # idempotent
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in sep.named_parameters()]
    assert list(fused.state_dict()) == list(sep.state_dict())
    for (n, a), (_, b) in zip(fused.named_parameters(), sep.named_parameters()):
        assert a.shape == b.shape and torch.equal(a, b), n
    attn = fused.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_fused.weight_rows.data_ptr()  # the parameters view the fused weight
    seqs = _seqs(sep.config.vocab_size)
    (lp_s, h_s), (lp_f, h_f) = _run(sep, seqs), _run(fused, seqs)
    assert torch.equal(h_f, h_s)
    for a, b in zip(lp_f, lp_s):
        assert torch.equal(a, b)
    # the fused path really ran: per layer 4 linear calls instead of 7 (q, k, v, o, gate, up, down)
    assert _calls(sep, seqs) - _calls(fused, seqs) == 3 * layers
    # and every residual add ran inside the norm that reads the sum: each layer's post-attention norm, every input norm
    # but the first layer's and the final norm returned (normed, sum)
    assert _norms_with_residual(fused, seqs) == 2 * layers and _norms_with_residual(sep, seqs) == 0
    # native: fused vs separate GEMMs recorded (vendor libraries choose their own blocking by N)
    with rk.mode("native"):
        (_, hn_s), (_, hn_f) = _run(sep, seqs), _run(fused, seqs)
    record_native(f"decoder hidden states, fused vs separate projections ({dtype})", int((hn_s != hn_f).sum()))


def test_fused_weights_follow_in_place_loads(checkpoint):
    sep = StrictDecoder.from_pretrained(checkpoint)
    fused = copy.deepcopy(sep)
    fused.fuse_projections()
    g = torch.Generator().manual_seed(7)
    new = {n: p.detach() + 0.01 * torch.randn(p.shape, generator=g) for n, p in sep.named_parameters()}
    sep.load_hf_weights(new)
    fused.load_hf_weights(new)  # copies into the views: the fused weight moves with them
    seqs = _seqs(sep.config.vocab_size)
    (lp_s, h_s), (lp_f, h_f) = _run(sep, seqs), _run(fused, seqs)
    assert torch.equal(h_f, h_s) and all(torch.equal(a, b) for a, b in zip(lp_f, lp_s))
    before = _run(StrictDecoder.from_pretrained(checkpoint), seqs)[1]
    assert not torch.equal(h_f, before)  # control: the load changed the output


def test_fused_falls_back_for_gradients_and_moved_parameters(checkpoint):
    sep = StrictDecoder.from_pretrained(checkpoint)
    fused = copy.deepcopy(sep)
    fused.fuse_projections()
    seqs = _seqs(sep.config.vocab_size)
    # gradients wanted: the separate GEMMs run, so every projection gets its .grad (the fused GEMM would leave it None)
    ids, cu = torch.tensor(seqs[1]), torch.tensor([0, len(seqs[1])])
    fused.forward_packed(ids, cu).float().square().sum().backward()
    sep.forward_packed(ids, cu).float().square().sum().backward()
    for (n, a), (_, b) in zip(fused.named_parameters(), sep.named_parameters()):
        assert (a.grad is None) == (b.grad is None) and (b.grad is None or torch.equal(a.grad, b.grad)), n
        if any(f"{p}_proj." in n for p in ("q", "k", "v", "gate", "up")):
            assert a.grad is not None, n
    # a parameter given its own storage (as `.to()` across devices or `.data =` would): detected, separate GEMMs
    up = fused.model.layers[0].mlp.up_proj
    up.weight.data = up.weight.data.clone()
    with torch.no_grad():
        up.weight.add_(0.5)  # only the moved copy changes; the stale fused rows must not be used
        sep.model.layers[0].mlp.up_proj.weight.add_(0.5)
    calls = _calls(fused, seqs)
    (lp_s, h_s), (lp_f, h_f) = _run(sep, seqs), _run(fused, seqs)
    assert torch.equal(h_f, h_s) and all(torch.equal(a, b) for a, b in zip(lp_f, lp_s))
    layers = sep.config.num_layers  # layer 0's MLP runs gate and up apart again; everything else stays fused
    assert calls == _calls(sep, seqs) - 2 - 3 * (layers - 1)


def test_hooks_see_what_the_fused_residuals_skip(checkpoint):
    """A hook on a norm, a layer or the final norm (as `vime diagnose` places them) gets the values of the plain forward
    there (the sum a norm reads, a layer's output); the fusions around it still run, and the bits stay."""
    sep = StrictDecoder.from_pretrained(checkpoint)
    fused = copy.deepcopy(sep)
    fused.fuse_projections()
    seqs = _seqs(sep.config.vocab_size)
    layers = sep.config.num_layers
    seen = {}

    def hook(key):
        def fn(module, args, out):
            seen.setdefault(key, []).append((args[0].clone(), (out[0] if isinstance(out, tuple) else out).clone()))
        return fn

    want = _run(sep, seqs)[1]
    for tag, m in (("sep", sep), ("fused", fused)):
        hs = [m.model.layers[layers - 1].post_attention_layernorm.register_forward_hook(hook((tag, "post"))),
              m.model.layers[0].register_forward_hook(hook((tag, "layer0"))),
              m.model.norm.register_forward_hook(hook((tag, "final")))]
        try:
            assert torch.equal(_run(m, seqs)[1], want)
            if tag == "fused":  # layer 0, the last layer and the final norm run plain; the layers between still fuse
                # (their post-attention norms, and their input norms but the first's: layer 0 left nothing pending)
                assert _norms_with_residual(m, seqs) == max(0, 2 * (layers - 2) - 1)
        finally:
            for h in hs:
                h.remove()
    for key in ("post", "layer0", "final"):
        pairs = zip(seen[("sep", key)], seen[("fused", key)])
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in pairs), key
    assert _norms_with_residual(fused, seqs) == 2 * layers  # hooks removed: every add fused again


@pytest.mark.parametrize("arch,heads", [("qwen3", (4, 2)), ("llama", (6, 2))])
def test_the_gpu_parity_harness_compares_the_engine_layout_with_the_plain_model(monkeypatch, arch, heads):
    """scripts/gpu_strict_parity.py's parity (rollout-style paged decode with shifting batches vs training-style packed
    scoring) runs its rollout side in the engine layout and its training side on the plain model; on the CPU's strict
    backend, at a tiny shape, it finds every token equal (on the H200 the same code runs the Triton fusions). Both
    architectures its `--dims` takes (llama: no head norms, and a GQA group of 3 like SmolLM2's)."""
    import types
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    monkeypatch.syspath_prepend(scripts)
    import gpu_strict_parity as P

    monkeypatch.setattr(P, "DEV", "cpu")
    monkeypatch.setattr(P, "QWEN3_8B", {**P.QWEN3_8B, **dict(hidden_size=64, intermediate_size=96, num_heads=heads[0],
                                                            num_kv_heads=heads[1], head_dim=16, vocab_size=300)})
    monkeypatch.setattr(P, "ARCH", {"arch": arch})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    res = {}
    model = P.build_model(2)
    assert model.config.arch == arch and (arch == "qwen3") == model.config.qk_norm
    P.parity(types.SimpleNamespace(seqs=8, gen_min=4, gen_max=9, concurrency=3, layers=2), res, model)
    assert res["parity_setup"]["rollout_layout"].startswith("engine") and res["parity"]["compared_tokens"] > 40
    assert res["parity"]["mismatch_count"] == 0 and res["parity"]["rerun_other_batches"]["mismatch_count"] == 0
    assert res["parity"]["rollout_hash"] == res["parity"]["training_hash"]
    # control: the harness's comparison sees one weight moved by one bf16 place (a q/k/v projection of layer 0)
    import copy

    seqs, plens = P.make_seqs(8, 300, (16, 256), (4, 9), seed=7)
    bumped = copy.deepcopy(model)
    w = next(p for n, p in bumped.named_parameters() if ".0." in n and p.dim() == 2 and "embed" not in n)
    with torch.no_grad():
        w.view(torch.int16)[0, 0] += 1
        tr, tr_b = (P.training_logprobs(m, seqs, plens, pack_tokens=32768, seed=1) for m in (model, bumped))
    moved = P.compare(tr, tr_b)
    assert w.dtype == torch.bfloat16 and moved["mismatch_count"] > 0 and moved["max_abs_diff"] > 0, moved


def test_the_gpu_layouts_diagnosis_finds_every_layout_exact_and_names_a_changed_op(monkeypatch):
    """scripts/gpu_strict_parity.py --only layouts (which piece of the engine layout, or which op, makes a GPU rollout
    differ from packed scoring): on the CPU's strict backend every layout's rollout equals packed scoring and every
    captured site is equal (llama, GQA 3 like SmolLM2). Negative control: with one layer's down_proj weight changed on
    the scoring side only, the site comparison names that op as the first whose output differs on equal input."""
    import types
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    monkeypatch.syspath_prepend(scripts)
    import gpu_strict_parity as P

    monkeypatch.setattr(P, "DEV", "cpu")
    monkeypatch.setattr(P, "QWEN3_8B", {**P.QWEN3_8B, **dict(hidden_size=64, intermediate_size=96, num_heads=6,
                                                            num_kv_heads=2, head_dim=16, vocab_size=300)})
    monkeypatch.setattr(P, "ARCH", {"arch": "llama"})
    res = {}
    model = P.build_model(2)
    P.layouts(types.SimpleNamespace(seqs=6, gen_min=3, gen_max=6, concurrency=3, layers=2), res, model)
    out = res["layouts"]
    assert set(out["variants"]) == set(P.LAYOUTS)
    for kind, v in out["variants"].items():
        assert v["vs_packed_plain"]["compared_tokens"] > 15 and v["vs_packed_plain"]["mismatch_count"] == 0, kind
        assert v["rerun_other_batches"]["compared_tokens"] > 15 and v["rerun_other_batches"]["mismatch_count"] == 0
    assert out["variants"]["engine"]["packed_engine_vs_plain"]["mismatch_count"] == 0
    plain = {r["site"] for r in out["sites"]["plain"]["sites"]}
    assert {"model.embed_tokens", "model.layers.1.mlp.down_proj", "model.layers.0", "model.norm"} <= plain
    engine = {r["site"] for r in out["sites"]["engine"]["sites"]}
    assert {"model.layers.0.self_attn.qkv_fused", "model.layers.1.mlp.gate_up_fused"} <= engine
    for kind in ("plain", "engine"):
        assert out["sites"][kind]["first_divergence"] is None
        assert all(r["rows"] > 30 and r["out_differ"] == 0 and not r.get("in_differ") for r in out["sites"][kind]["sites"])

    # negative control: the scoring side's layer-1 down_proj changed
    seqs, plens = P.make_seqs(4, 300, (16, 20), (3, 5), seed=7)
    watch = lambda n, m: not list(m.children()) or n.count(".") == 2  # noqa: E731
    with torch.no_grad():
        cap_r = P.SiteCapture(model, watch)
        P.rollout(model, seqs, plens, 2, P.PagedCache(2, 64, 16, 2, 16, seed=3), seed=11)
        cap_r.close()
        other = P._layout(model, "plain")
        other.model.layers[1].mlp.down_proj.weight[0, 0] += 0.5
        cap_t = P.SiteCapture(other, watch)
        P.training_logprobs(other, seqs, plens, pack_tokens=4096)
        cap_t.close()
    sites = P.compare_sites(cap_r, cap_t)
    first = next(r for r in sites if r["out_differ"] and not r.get("in_differ"))
    assert first["site"] == "model.layers.1.mlp.down_proj" and first["max_abs"] > 0
    assert all(r["out_differ"] == 0 for r in sites[:[r["site"] for r in sites].index(first["site"])])

"""Claims: the strict decoder is the same function as HF transformers (logits within 1e-4
relative on float32 checkpoints, Qwen3 and Llama, tied and untied, odd sizes); its packed
scorer gives a sequence the same bits alone or packed with others (native scoring's difference recorded); loading rejects
mismatched weights."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import rlkernel as rk
from helpers import record_native
from rlkernel.models import DecoderConfig, StrictDecoder, pack_sequences
from vime.tiny_model import make_tiny_checkpoint

CASES = {
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True),
    "qwen3-untied-odd": dict(arch="qwen3", tie_word_embeddings=False, vocab_size=131, hidden_size=72, intermediate_size=136, num_heads=6, num_kv_heads=2, head_dim=12),
    "llama-untied": dict(arch="llama", tie_word_embeddings=False, vocab_size=113),
    "llama-tied-odd": dict(arch="llama", tie_word_embeddings=True, vocab_size=127, hidden_size=48, intermediate_size=100, num_heads=3, num_kv_heads=1, head_dim=16),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), seed=3, init_std=0.08, **CASES[request.param])


def _seqs(vocab, g):
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (1, 9, 33, 70)]


def test_strict_decoder_matches_hf_transformers(checkpoint):
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = StrictDecoder.from_pretrained(checkpoint)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for s in _seqs(ours.config.vocab_size, g):
            ref = hf(torch.tensor([s])).logits[0]
            got = ours.logits(ours.forward_packed(torch.tensor(s), torch.tensor([0, len(s)])))
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
            if len(s) == 1:
                assert ours.score([s])[0].numel() == 0
                continue
            lp_ref = torch.log_softmax(ref[:-1].double(), -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0]
            lp = ours.score([s])[0]
            assert lp.dtype == torch.float32 and (lp.double() - lp_ref).abs().max().item() < 1e-4


def test_row_segments_is_the_same_function_in_another_order(checkpoint):
    """rlkernel.row_segments=1 (plain GEMMs in the row-parallel layers, what vime passes both engines for a TP=1 run):
    still HF transformers' function (the tolerance above), and another sum order than the default 4 canonical segments
    (the bits differ: the knob reaches the layers; a run's two engines must agree on it)."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    plain, default = StrictDecoder.from_pretrained(checkpoint, row_segments=1), StrictDecoder.from_pretrained(checkpoint)
    assert (plain.config.row_segments, default.config.row_segments) == (1, 4)
    g, differ = torch.Generator().manual_seed(0), 0
    with torch.no_grad():
        for s in _seqs(plain.config.vocab_size, g):
            cu = torch.tensor([0, len(s)])
            got = plain.logits(plain.forward_packed(torch.tensor(s), cu))
            ref = hf(torch.tensor([s])).logits[0]
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
            differ += int((got != default.logits(default.forward_packed(torch.tensor(s), cu))).sum())
    assert differ > 0


def test_packed_scoring_is_batch_invariant(checkpoint):
    """Each sequence's logprobs are bitwise the same scored alone or packed with others."""
    m = StrictDecoder.from_pretrained(checkpoint, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    seqs = _seqs(m.config.vocab_size, g)
    with torch.no_grad():
        packed = m.score(seqs, temperature=0.8)
        for s, lp in zip(seqs, packed):
            assert torch.equal(m.score([s], temperature=0.8)[0], lp)
        assert torch.equal(m.score(seqs[::-1], temperature=0.8)[0], packed[-1])
        with rk.mode("native"):  # negative control, recorded (helpers.record_native)
            packed_n = m.score(seqs, temperature=0.8)
            differ = sum(int((m.score([s], temperature=0.8)[0] != lp).sum()) for s, lp in zip(seqs, packed_n))
    record_native("native scoring bf16, a sequence's logprobs alone vs packed", differ)


def test_config_and_weight_errors(checkpoint):
    m = StrictDecoder.from_pretrained(checkpoint)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd["model.layers.0.mlp.gate_proj.weight"] = sd["model.layers.0.mlp.gate_proj.weight"][:-1]
    with pytest.raises(ValueError):
        m.load_hf_weights(sd)
    with pytest.raises(KeyError):
        m.load_hf_weights({"nonsense.weight": torch.zeros(1)})
    with pytest.raises(ValueError):
        DecoderConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError):
        pack_sequences([[1, 2], []])


def test_rope_position_bound_changes_no_bit_and_is_enforced():
    """A model bounded by set_max_positions (what an engine does with its max_model_len, so a GPU
    decode step never reads positions back) gives the bits of the unbounded model; a position at
    or past the bound is refused, not silently rotated by a wrong table."""
    import rlkernel as rk
    torch.manual_seed(0)
    x, pos = torch.randn(5, 3, 8), torch.tensor([0, 7, 3, 30, 2])
    assert torch.equal(rk.rope(x, pos, 10000.0, max_position=64), rk.rope(x, pos, 10000.0))
    with pytest.raises(ValueError, match="max_position"):
        rk.rope(x, pos, 10000.0, max_position=30)
    # positions marked below a bound by their maker (the trainer's packed positions) skip the check only where the
    # bound covers the mark: a mark above max_position is still checked
    from rlkernel.backends.reference.rope import mark_below, negated_sin, rope_table
    with pytest.raises(ValueError, match="max_position"):
        rk.rope(x, mark_below(pos.clone(), 31), 10000.0, max_position=30)
    assert torch.equal(rk.rope(x, mark_below(pos.clone(), 31), 10000.0, max_position=31), rk.rope(x, pos, 10000.0))
    # checked once for a forward: a marked view (the caller's tensor stays unmarked), refused past the bound
    from rlkernel.backends.reference.rope import checked_below
    view = checked_below(pos, 31)
    assert view._rk_below == 31 and not hasattr(pos, "_rk_below") and torch.equal(view, pos)
    assert torch.equal(rk.rope(x, view, 10000.0, max_position=31), rk.rope(x, pos, 10000.0))
    with pytest.raises(ValueError, match="max_position"):
        checked_below(pos, 30)
    _, sin = rope_table(8, 64, 10000.0)
    assert negated_sin(sin) is negated_sin(sin) and torch.equal(negated_sin(sin), -sin)  # once per table, exact
    with torch.inference_mode():  # a table made under vLLM's inference mode (the in-process executor) has no version
        inf_sin = sin.clone()
    assert torch.equal(negated_sin(inf_sin), -sin) and negated_sin(inf_sin) is negated_sin(inf_sin)


def test_decoder_checks_the_rope_bound_once_a_forward(checkpoint):
    """With an engine's bound set (set_max_positions), the decoder checks the positions once a forward (a marked view,
    so its 2 rope calls a layer skip their own checks): the same bits as without a bound, and a position past it is
    refused before any layer runs."""
    m = StrictDecoder.from_pretrained(checkpoint)
    ids = torch.randint(4, m.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(12)
    attend = lambda _, q, k, v: rk_attention(q, k, v)  # noqa: E731
    with torch.no_grad():
        free = m.hidden_states(ids, pos, attend)
        m.set_max_positions(12)
        assert torch.equal(m.hidden_states(ids, pos, attend), free) and not hasattr(pos, "_rk_below")
        m.set_max_positions(11)
        with pytest.raises(ValueError, match="max_position"):
            m.hidden_states(ids, pos, attend)


def rk_attention(q, k, v):
    from rlkernel.ops.attention import attention_varlen
    return attention_varlen(q, k, v, torch.tensor([0, q.shape[0]]))


def _tensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("case,dtype", [("qwen3-untied-odd", "bfloat16"), ("llama-tied-odd", "float32")])
def test_streamed_checkpoint_has_the_hf_layout_and_loads(case, dtype, tmp_path, capsys):
    """make_tiny_checkpoint(init="stream") (the GPU runs' random Qwen3-8B, without building the model in float32):
    the files `save_pretrained` writes (config.json and generation_config.json equal to init="hf"'s, the same weight
    names, shapes and dtypes, the shard index where it shards), loaded by HF transformers with no missing or
    unexpected weight and scored by the strict decoder as HF scores it; each weight drawn from (seed, name) alone
    (other shards, same tensors; another seed, other tensors), std as asked, norms around 1."""
    import json

    kw = dict(CASES[case], dtype=dtype, seed=3, init_std=0.08)
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", **kw)
    capsys.readouterr()
    st = make_tiny_checkpoint(tmp_path / "st", init="stream", max_shard_bytes=40_000, **kw)
    assert "make_tiny_checkpoint: model-00001-of-" in capsys.readouterr().err  # progress per shard
    for name in ("config.json", "generation_config.json"):
        assert json.loads((st / name).read_text()) == json.loads((hf_dir / name).read_text()), name
    index = json.loads((st / "model.safetensors.index.json").read_text())
    a, b = _tensors(hf_dir), _tensors(st)
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(b)
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
    one = _tensors(make_tiny_checkpoint(tmp_path / "one", init="stream", **kw))  # one file: other shards
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    assert all(torch.equal(one[k].view(torch.uint8), b[k].view(torch.uint8)) for k in b)
    other = _tensors(make_tiny_checkpoint(tmp_path / "seed4", init="stream", **(kw | {"seed": 4})))
    assert all(not torch.equal(other[k], b[k]) for k in b)
    norms = torch.cat([v.float().flatten() for k, v in b.items() if k.endswith("norm.weight")])
    rest = torch.cat([v.float().flatten() for k, v in b.items() if not k.endswith("norm.weight")])
    assert abs(norms.mean().item() - 1) < 0.02 and abs(norms.std().item() - 0.1) < 0.02
    assert abs(rest.mean().item()) < 0.002 and abs(rest.std().item() / 0.08 - 1) < 0.01

    hf, info = AutoModelForCausalLM.from_pretrained(st, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = StrictDecoder.from_pretrained(st)
    s = torch.randint(4, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([s])).logits[0]
        got = ours.logits(ours.forward_packed(torch.tensor(s), torch.tensor([0, len(s)])))
    assert ((got - ref).abs().max() / ref.abs().max()).item() < (1e-4 if dtype == "float32" else 2e-2)


def test_streamed_checkpoint_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="init must be 'hf' or 'stream'"):
        make_tiny_checkpoint(tmp_path / "x", init="fast")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            make_tiny_checkpoint(tmp_path / "y", init="stream", device="cuda")

"""Claims: HF <-> Megatron conversion is pure data movement.

1. Round trip HF -> per-rank Megatron shards -> HF is bitwise (torch.equal) at TP 1, 2 and
   4, for Qwen3 (q/k norms) and Llama, tied and untied, with q/k/v biases, float32 and
   bfloat16; tied exports carry no lm_head.
2. Shard layout is Megatron's: QKV interleaved per kv group (rank r holds whole groups),
   fc1 shard = [gate_r; up_r], row-parallel weights split by input columns, vocab padded
   with zero rows to S_v canonical segments of whole VOCAB_TILEs (TP > 1).
   (The distributed gather of the same shards is checked in test_megatron_tp.py, and a
   real Megatron model loads them with strict=True in every engine test.)
3. Configurations Megatron cannot shard here raise ValueError (kv heads not divisible by tp,
   canonical row segments not divisible by tp).
"""
import dataclasses

import pytest
import torch

import rlkernel as rk
from rlkernel.integrations.megatron_convert import hf_to_megatron, megatron_to_hf
from rlkernel.integrations.megatron_spec import MegatronSpecConfig
from rlkernel.models import DecoderConfig, StrictDecoder

BASE = dict(vocab_size=600, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
            head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4)
CASES = {
    "qwen3-tied-bias": dict(arch="qwen3", tie_word_embeddings=True, attention_bias=True),
    "llama-untied": dict(arch="llama", tie_word_embeddings=False),
}


def _hf(case: str, dtype: str) -> tuple[DecoderConfig, dict]:
    cfg = DecoderConfig(**BASE, **CASES[case])
    torch.manual_seed(0)
    model = StrictDecoder(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p.float()).to(p.dtype))  # every element distinct: a misplaced one shows
    sd = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return cfg, sd


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_bitwise(case, dtype, tp):
    dec, hf = _hf(case, dtype)
    cfg = MegatronSpecConfig(decoder=dec, tp=tp, dtype=dtype)
    shards = [hf_to_megatron(hf, cfg, r) for r in range(tp)]
    back = megatron_to_hf(shards, cfg)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_shard_layout_is_megatrons():
    dec, hf = _hf("qwen3-tied-bias", "float32")
    cfg = MegatronSpecConfig(decoder=dec, tp=2)
    s1 = hf_to_megatron(hf, cfg, 1)
    L, a = "gpt.decoder.layers.0.", "model.layers.0.self_attn."
    hd, r = dec.head_dim, dec.num_heads // dec.num_kv_heads
    # rank 1 holds kv groups 2 and 3: [q of group 2 (r heads); k_2; v_2; q of group 3; k_3; v_3]
    q, k, v = (hf[a + f"{p}_proj.weight"] for p in "qkv")
    want = torch.cat([torch.cat([q[g * r * hd:(g + 1) * r * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]) for g in (2, 3)])
    assert torch.equal(s1[L + "self_attention.linear_qkv.weight"], want)
    F = dec.intermediate_size // 2
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(s1[L + "mlp.linear_fc1.weight"], torch.cat([gate[F:], up[F:]]))
    assert torch.equal(s1[L + "mlp.linear_fc2.weight"], hf["model.layers.0.mlp.down_proj.weight"][:, F:])
    assert torch.equal(s1[L + "self_attention.linear_proj.weight"], hf[a + "o_proj.weight"][:, dec.num_heads * hd // 2:])
    # vocab: S_v = 4 canonical segments of whole tiles, the same at every TP size (600 rows: 2 tiles -> 1 tile per
    # segment), so TP=2 pads to 4 tiles and rank 0 holds rows [0, 1024): every true row; rank 1 padding only
    emb0, emb = hf_to_megatron(hf, cfg, 0)["gpt.embedding.word_embeddings.weight"], s1["gpt.embedding.word_embeddings.weight"]
    assert (cfg.vocab_segments, cfg.vocab_segment_rows) == (4, rk.VOCAB_TILE)
    assert cfg.padded_vocab == 4 * rk.VOCAB_TILE and emb.shape[0] == emb0.shape[0] == 2 * rk.VOCAB_TILE
    assert torch.equal(emb0[: dec.vocab_size], hf["model.embed_tokens.weight"]) and not emb0[dec.vocab_size:].any()
    assert not emb.any()
    assert "output_layer.weight" not in s1  # tied


def test_unshardable_configs_raise():
    dec = DecoderConfig(**BASE, arch="llama", tie_word_embeddings=False)
    with pytest.raises(ValueError, match="kv heads"):
        MegatronSpecConfig(decoder=dec, tp=8)
    with pytest.raises(ValueError, match="canonical"):
        MegatronSpecConfig(decoder=dataclasses.replace(dec, row_segments=2), tp=4)
    with pytest.raises(ValueError, match="rank"):
        hf_to_megatron({}, MegatronSpecConfig(decoder=dec, tp=2), 2)


def _lazy_export_body(rank, case, dtype, tp):
    import gc

    import torch.distributed as dist

    from rlkernel.integrations.megatron_convert import gather_shards

    dec, hf = _hf(case, dtype)
    cfg = MegatronSpecConfig(decoder=dec, tp=tp, dtype=dtype)
    local, full = hf_to_megatron(hf, cfg, rank), hf_to_megatron(hf, MegatronSpecConfig(decoder=dec, tp=1, dtype=dtype), 0)
    params = {}
    for k, v in local.items():  # Megatron's mark on a TP-sharded parameter, as its layers set it
        params[k] = torch.nn.Parameter(v.clone(), requires_grad=False)
        params[k].tensor_model_parallel = v.shape != full[k].shape
    shards = gather_shards(local, params, dist.group.WORLD)
    back = megatron_to_hf(shards, cfg)
    gc.collect()
    again = gather_shards(local, params, dist.group.WORLD)  # rank 0 keeps the export, rank 1 only takes part
    kept = megatron_to_hf(again, cfg, keep=rank == 0)
    return {"kept": len(kept) if rank else all(torch.equal(kept[n], t) for n, t in hf.items()) and set(kept) == set(hf),
            "again_gathers": again.gathers,
            "equal": set(back) == set(hf) and all(torch.equal(back[n], t) for n, t in hf.items()),
            "gathers": shards.gathers, "sharded": sum(bool(p.tensor_model_parallel) for p in params.values()),
            "alive": sum(r() is not None for r in shards.gathered[:-1])}


@pytest.mark.parametrize("case", list(CASES))
def test_lazy_gather_exports_one_parameter_at_a_time(tmp_path, case):
    """The trainer's export at TP > 1 (gather_shards + megatron_to_hf, two gloo ranks): every HF tensor bit-equal to the
    checkpoint the shards came from, each TP-sharded parameter gathered exactly once, and after the export no gathered
    parameter but the last is still alive (weak references to each gather's output): an export needs its output plus
    one parameter's gather (on a GPU at 8B: 16 GB, not the ~48 GB of every shard, the joined tensors and their copies
    at once). Keeping every gather (the eager gather_shards before session 32) fails it: 10 of 11 alive. A rank that
    only takes part (keep=False: the host path's ranks but 0) runs the same gathers and holds nothing."""
    from helpers import run_gloo_ranks

    ranks = run_gloo_ranks(2, _lazy_export_body, (case, "float32", 2), str(tmp_path))
    assert ranks[0]["kept"] is True and ranks[1]["kept"] == 0  # keep=False: the gathers, nothing held
    for r in ranks:
        assert r["equal"] and r["again_gathers"] == r["gathers"]
        assert r["gathers"] == r["sharded"] > 0
        assert r["alive"] == 0, r

"""HF <-> Megatron weight conversion for `StrictGPTModel`, sharded by TP rank, both directions.

What this module decides: the exact tensor layout of every parameter of the Megatron
model at any TP size, so that conversion is pure data movement (slicing, concatenation,
zero padding of vocab rows) and a round trip HF -> Megatron -> HF is bitwise.

Layouts (full = TP 1; rank r of tp holds the named slice):
* QKV (`linear_qkv`, column): Megatron interleaves per kv group g: [q heads of g; k_g; v_g],
  i.e. view [ng, (np/ng + 2) * hd, H]; rank r holds groups [r*ng/tp, (r+1)*ng/tp).
  Biases (Qwen2-style `attention_bias`) the same way.
* fc1 (column, stride 2): rank r holds [gate rows of r; up rows of r], not a half of the
  full [gate; up] tensor.
* o_proj / down_proj (row): columns [r*K/tp, (r+1)*K/tp): the rank's own heads / fc1 units.
* embedding / lm_head: rows padded with zeros to `padded_vocab`, rank r holds rows
  [r*V_pad/tp, (r+1)*V_pad/tp); padding rows are dropped on the way back.
* norms (layer, q/k, final) are replicated.
Tied models have no `output_layer.weight` and no `lm_head.weight` on export (HF ties on load).
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch

from .megatron_spec import MegatronSpecConfig

_LAYER_NORMS = (("input_layernorm", "input_layernorm"), ("pre_mlp_layernorm", "post_attention_layernorm"))
_EMBED = "gpt.embedding.word_embeddings.weight"


def _mg(i: int) -> str:
    return f"gpt.decoder.layers.{i}."


def _hf(i: int) -> str:
    return f"model.layers.{i}."


def _groups(cfg: MegatronSpecConfig, x: torch.Tensor, width: int) -> torch.Tensor:
    """[ng * width, ...] -> [ng, width, ...]."""
    return x.reshape(cfg.decoder.num_kv_heads, width, *x.shape[1:])


def _fuse_qkv(cfg, q, k, v, rank):
    d = cfg.decoder
    r, hd, per = d.num_heads // d.num_kv_heads, d.head_dim, d.num_kv_heads // cfg.tp
    fused = torch.cat([_groups(cfg, q, r * hd), _groups(cfg, k, hd), _groups(cfg, v, hd)], dim=1)
    return fused[rank * per:(rank + 1) * per].reshape(-1, *q.shape[1:])


def _split_qkv(cfg, parts):
    d = cfg.decoder
    r, hd = d.num_heads // d.num_kv_heads, d.head_dim
    full = torch.cat(list(parts), dim=0)
    g = full.reshape(d.num_kv_heads, (r + 2) * hd, *full.shape[1:])
    q, k, v = g.split([r * hd, hd, hd], dim=1)
    return (q.reshape(-1, *full.shape[1:]), k.reshape(-1, *full.shape[1:]), v.reshape(-1, *full.shape[1:]))


def _rows(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x.chunk(world, dim=0)[rank]


def _cols(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x.chunk(world, dim=1)[rank]


def _pad_vocab(cfg, w):
    extra = cfg.padded_vocab - w.shape[0]
    return torch.cat([w, w.new_zeros(extra, w.shape[1])]) if extra else w


def hf_to_megatron(hf: Mapping[str, torch.Tensor], cfg: MegatronSpecConfig, rank: int = 0) -> dict[str, torch.Tensor]:
    """TP rank `rank`'s state dict of StrictGPTModel from HF-named tensors, cast to cfg.dtype."""
    d, tp = cfg.decoder, cfg.tp
    if not 0 <= rank < tp:
        raise ValueError(f"hf_to_megatron: rank {rank} outside tp={tp}")
    dt = cfg.torch_dtype

    def get(name):
        if name not in hf:
            raise KeyError(f"hf_to_megatron: checkpoint has no {name!r}")
        return hf[name].to(dt)  # the same round-to-nearest cast StrictDecoder's load applies

    out = {_EMBED: _rows(_pad_vocab(cfg, get("model.embed_tokens.weight")), rank, tp)}
    for i in range(d.num_layers):
        m, h = _mg(i), _hf(i)
        for mg_name, hf_name in _LAYER_NORMS:
            out[m + mg_name + ".weight"] = get(h + hf_name + ".weight")
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(cfg, *(get(a + f"{p}_proj.weight") for p in "qkv"), rank)
        if d.attention_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(cfg, *(get(a + f"{p}_proj.bias") for p in "qkv"), rank)
        if d.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = get(a + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = get(a + "k_norm.weight")
        out[m + "self_attention.linear_proj.weight"] = _cols(get(a + "o_proj.weight"), rank, tp)
        gate, up = get(h + "mlp.gate_proj.weight"), get(h + "mlp.up_proj.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat([_rows(gate, rank, tp), _rows(up, rank, tp)])
        out[m + "mlp.linear_fc2.weight"] = _cols(get(h + "mlp.down_proj.weight"), rank, tp)
    out["final_layernorm.weight"] = get("model.norm.weight")
    if not d.tie_word_embeddings:
        out["output_layer.weight"] = _rows(_pad_vocab(cfg, get("lm_head.weight")), rank, tp)
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], cfg: MegatronSpecConfig, keep: bool = True) -> dict[str, torch.Tensor]:
    """HF-named full tensors from every TP rank's state dict (rank order); replicated params from rank 0. keep=False:
    every shard read in the same order (a lazy gather's collectives) but nothing kept — {} (a rank that only takes
    part in another rank's export)."""
    d = cfg.decoder
    if len(shards) != cfg.tp:
        raise ValueError(f"megatron_to_hf: got {len(shards)} shards for tp={cfg.tp}")

    def cat(name, dim):
        return torch.cat([s[name] for s in shards], dim=dim)

    class _Own(dict):  # each entry copied as it is made (never a view of a shard or of a live parameter), so a lazy
        def __setitem__(self, k, v):  # gather (gather_shards) frees each name's parts before the next name's
            if keep:
                super().__setitem__(k, v.contiguous().clone())

    first = shards[0]
    hf = _Own()
    hf["model.embed_tokens.weight"] = cat(_EMBED, 0)[: d.vocab_size]
    for i in range(d.num_layers):
        m, h = _mg(i), _hf(i)
        for mg_name, hf_name in _LAYER_NORMS:
            hf[h + hf_name + ".weight"] = first[m + mg_name + ".weight"]
        a = h + "self_attn."
        q, k, v = _split_qkv(cfg, [s[m + "self_attention.linear_qkv.weight"] for s in shards])
        hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"] = q, k, v
        if d.attention_bias:
            q, k, v = _split_qkv(cfg, [s[m + "self_attention.linear_qkv.bias"] for s in shards])
            hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"] = q, k, v
        if d.qk_norm:
            hf[a + "q_norm.weight"] = first[m + "self_attention.q_layernorm.weight"]
            hf[a + "k_norm.weight"] = first[m + "self_attention.k_layernorm.weight"]
        hf[a + "o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        halves = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        hf[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        hf[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
        hf[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
    hf["model.norm.weight"] = first["final_layernorm.weight"]
    if not d.tie_word_embeddings:
        hf["lm_head.weight"] = cat("output_layer.weight", 0)[: d.vocab_size]
    return dict(hf)


def gather_shards(local: Mapping[str, torch.Tensor], params: Mapping[str, torch.nn.Parameter], group,
                  keep_device: bool = False) -> "LazyShards":
    """Every TP rank's state dict, on every rank, on the CPU (keep_device: where the gather left them, the params' own
    device): TP-sharded params all-gathered (rank order) on the param's own device (NCCL has no CPU tensors),
    replicated ones local. Lazily, one name at a time (LazyShards): every rank must read the names in the same order
    (megatron_to_hf's), and only the last name's parts stay alive — an export holds its output and one parameter's
    gather, not every shard of the model besides (at 8B in bf16 on a GPU: 16 GB, not ~48)."""
    return LazyShards(local, params, group, keep_device)


class LazyShards(Sequence):
    """gather_shards' result: shards[r][name] is rank r's part of `name`, all-gathered over `group` when a name is
    first read after another (a collective: every rank reads the same names in the same order); the previous name's
    parts are dropped first."""

    def __init__(self, local, params, group, keep_device: bool):
        self.local, self.params, self.group, self.keep_device = local, params, group, keep_device
        self.world = group.size()
        self._name, self._parts, self.gathers = None, None, 0
        self.gathered: list = []  # a weak reference to each gather's output: dead once its name is done (a test reads it)

    def __len__(self) -> int:
        return self.world

    def __getitem__(self, r: int):
        if not 0 <= r < self.world:
            raise IndexError(r)  # (also ends Sequence's iteration)
        return _RankView(self, r)

    def part(self, name: str, r: int) -> torch.Tensor:
        if name != self._name:
            self._name, self._parts = None, None  # the previous name's parts go before this one's gather
            self._name, self._parts = name, self._gather(name)
        return self._parts[r]

    def _gather(self, name: str) -> list[torch.Tensor]:
        from rlkernel import all_gather

        t = self.local[name].detach()
        if self.world > 1 and getattr(self.params.get(name), "tensor_model_parallel", False):
            on = self.params[name].device
            out = all_gather(t.to(on).unsqueeze(0), self.group, dim=0)
            self.gathered.append(weakref.ref(out))
            parts = list(out.unbind(0))
            self.gathers += 1
        else:
            parts = [t] * self.world
        return parts if self.keep_device else [p.cpu() for p in parts]


class _RankView(Mapping):
    def __init__(self, shards: LazyShards, rank: int):
        self.shards, self.rank = shards, rank

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shards.local:
            raise KeyError(name)
        return self.shards.part(name, self.rank)

    def __iter__(self):
        return iter(self.shards.local)

    def __len__(self) -> int:
        return len(self.shards.local)

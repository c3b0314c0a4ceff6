"""Qwen3 / Llama decoder built only from rlkernel ops, with HF parameter names.

What this module decides: the one model function both engines run. The vLLM
plugin wraps it (its attention callable reads a paged KV cache), the
standalone packed scorer calls it with varlen attention, and the Megatron spec
mirrors its op sequence. Llama is Qwen3 without the per-head q/k RMSNorm.
Weights keep HF names (`model.layers.N.self_attn.q_proj.weight`, ...) so a
`save_pretrained` checkpoint loads with no conversion. q/k/v and gate/up are
separate parameters; `fuse_projections()` (the vLLM engine's model calls it) lays
each group out as views of one weight and runs it as one GEMM — the strict
linear's columns do not see their neighbours, so the fused layout gives the same
bits (tests/test_decoder_fused.py; on the H200 `gpu_strict_parity.py --only reduce`).

The attention callable `attend(layer, q, k, v) -> out` receives roped
q [T, Hq, D] and k/v [T, Hkv, D] and owns the KV cache if there is one.
Under tensor parallelism (`TensorParallel`: vLLM's TP group in a rollout engine) each rank holds
its heads and MLP rows and merges the row-parallel partials by the canonical segment tree, so
every rank's output is the unsplit model's, bit for bit.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .. import ops  # noqa: F401  (registers backends)
from ..backends.reference.rope import checked_below
from ..ops.attention import attention_varlen
from ..ops.linear import canonical_segments, linear, linear_segment_partials
from ..ops.logprob import linear_logprob
from ..ops.norm import rms_norm, rms_norm_rope
from ..ops.rope import rope
from ..ops.swiglu import linear_swiglu, swiglu

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (vLLM's TP group inside a rollout engine): attention heads and
    MLP rows are split over the ranks, the row-parallel linears (o, down) merge every rank's canonical K-segment
    partials with `rlkernel.tree_all_reduce`, so each rank's output equals the unsplit model's bit for bit; the
    embedding, the norms and the lm_head are replicated."""
    rank: int
    world: int
    group: object  # a torch.distributed process group
    # every rank's tensor stacked [world, ...] in rank order by the engine's own communicator (vLLM's TP group
    # coordinator: one CUDA graphs can capture); None: torch.distributed's all_gather on `group`. Data only: same bits
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None


def _split(n: int, tp: TensorParallel | None, what: str) -> int:
    if tp is None:
        return n
    if n % tp.world:
        raise ValueError(f"tensor parallel size {tp.world} does not divide {what}={n}")
    return n // tp.world
_ARCHS = {"qwen3": True, "llama": False}  # arch -> has q/k norm
ROW_SEGMENTS = 4  # the canonical K-segment count when none is given (vime's rlkernel.row_segments defaults to it)


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderConfig:
    arch: str  # "qwen3" or "llama"
    vocab_size: int  # true vocab (rows of the lm_head that are read)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v projections
    # Canonical K-segments of the row-parallel GEMMs (o_proj, down_proj): their partials are
    # merged by one fixed tree, so any TP size dividing this count gives the same bits.
    row_segments: int = ROW_SEGMENTS

    def __post_init__(self):
        if self.arch not in _ARCHS:
            raise ValueError(f"arch must be one of {sorted(_ARCHS)}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "row_segments"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads cannot share {self.num_kv_heads} kv heads")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and (v >= 0 if name == "rms_norm_eps" else v > 0)):
                raise ValueError(f"{name} must be a finite number {'>= 0' if name == 'rms_norm_eps' else '> 0'}, got {v!r}")

    @property
    def qk_norm(self) -> bool:
        return _ARCHS[self.arch]

    @classmethod
    def from_hf(cls, cfg) -> "DecoderConfig":
        """From a transformers Qwen3Config / LlamaConfig (or its dict)."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        arch = get("model_type")
        if arch not in _ARCHS:
            raise ValueError(f"unsupported model_type {arch!r}; rlkernel models: {sorted(_ARCHS)}")
        rope_params = get("rope_parameters") or {}
        scaling = get("rope_scaling") or {}
        rope_type = (rope_params or scaling).get("rope_type", (rope_params or scaling).get("type", "default"))
        if rope_type not in (None, "default"):
            raise NotImplementedError(f"rope scaling {rope_type!r} is not in the strict contract yet")
        theta = rope_params.get("rope_theta", get("rope_theta", 10000.0))
        heads = get("num_attention_heads")
        return cls(
            arch=arch,
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads if get("num_key_value_heads") is None else get("num_key_value_heads"),  # 0 is refused
            head_dim=get("head_dim") or (get("hidden_size") // heads if heads else 0),
            rms_norm_eps=get("rms_norm_eps"),
            rope_theta=float(theta),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
        )


def _hooked(*mods: nn.Module) -> bool:
    """Whether a forward (pre-)hook watches any of `mods` (`vime diagnose`): the engine layout's fusions then step aside
    there, so the hook sees the values the plain forward computes."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in mods)


def _weight(*shape, dtype, device):
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


class _Linear(nn.Module):
    def __init__(self, n_in, n_out, bias, dtype, device, k_segments=1):
        super().__init__()
        self.weight = _weight(n_out, n_in, dtype=dtype, device=device)
        self.bias = _weight(n_out, dtype=dtype, device=device) if bias else None
        self.k_segments = k_segments

    def forward(self, x):
        return linear(x, self.weight, self.bias, k_segments=self.k_segments)


class _FusedRows(nn.Module):
    """One GEMM over several linears' weights laid back to back (`fuse_projections`): a module of its own, so forward
    hooks see it (`vime diagnose` splits its output into the linears' sites with `split`). Holds no parameters: the
    fused [sum N_i, K] weight is a plain attribute and each linear's parameter becomes a view of its rows (same name,
    shape and values; an in-place copy into it writes the fused weight and moves its version counter, which views
    share)."""

    def __init__(self, mods: Sequence[_Linear], names: Sequence[str]):
        super().__init__()
        ws = [m.weight for m in mods]
        self.linears = tuple(mods)  # a tuple, not registered: the parameters stay the linears' own
        self.names = tuple(names)
        self.sizes = tuple(w.shape[0] for w in ws)
        self.weight_rows = torch.cat([w.detach() for w in ws])
        for m, w, rows in zip(mods, ws, self.weight_rows.split(self.sizes)):
            m.weight = nn.Parameter(rows, requires_grad=w.requires_grad)

    def ok(self) -> bool:
        """The fused weight may serve this call: it still backs every linear's parameter (a `.to()` or an assignment
        to `.data` would have given one its own storage) and no gradient is wanted for them (the fused GEMM would not
        reach the parameters' .grad)."""
        if torch.is_grad_enabled() and any(m.weight.requires_grad for m in self.linears):
            return False
        return all(w.device == r.device and w.dtype == r.dtype and w.shape == r.shape and w.stride() == r.stride()
                   and w.data_ptr() == r.data_ptr()
                   for w, r in zip((m.weight for m in self.linears), self.weight_rows.split(self.sizes)))

    def forward(self, x):
        return linear(x, self.weight_rows)

    def split(self, y: torch.Tensor) -> dict:
        """The fused output as {linear name: its columns}."""
        return dict(zip(self.names, y.split(self.sizes, dim=-1)))


class _RowParallelLinear(_Linear):
    """A row-parallel linear (input split over the TP ranks): this rank's K-columns, merged over the group by the
    canonical segment tree (strict) or an all-reduce (native)."""

    def __init__(self, n_in_local, n_out, dtype, device, k_segments_local, tp: TensorParallel):
        super().__init__(n_in_local, n_out, False, dtype, device, k_segments_local)
        self.tp = tp

    def forward(self, x):
        from ..dispatch import current_policy
        from ..parallel.collectives import native_all_reduce, tree_all_reduce

        if current_policy().choice("linear") == "native":
            return native_all_reduce([linear(x, self.weight)], self.tp.group)
        return tree_all_reduce(linear_segment_partials(x, self.weight, self.k_segments), self.tp.group,
                               check=False, gather=self.tp.gather).to(x.dtype)  # (the same rows on every rank)


def _row_linear(n_in, n_out, dtype, device, row_segments, tp: TensorParallel | None):
    s = canonical_segments(n_in, row_segments)
    if tp is None:
        return _Linear(n_in, n_out, False, dtype, device, s)
    if s % tp.world:
        raise ValueError(f"tensor parallel size {tp.world} does not divide the {s} canonical K-segments of a row-parallel "
                         f"linear (K={n_in}, row_segments={row_segments})")
    return _RowParallelLinear(n_in // tp.world, n_out, dtype, device, s // tp.world, tp)


class _Norm(nn.Module):
    def __init__(self, n, eps, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.eps, residual=residual)


class _Attention(nn.Module):
    def __init__(self, c: DecoderConfig, dtype, device, tp: TensorParallel | None = None):
        super().__init__()
        self.c = c
        h, d = c.hidden_size, c.head_dim
        self.heads, self.kv_heads = _split(c.num_heads, tp, "num_heads"), _split(c.num_kv_heads, tp, "num_kv_heads")
        self.q_proj = _Linear(h, self.heads * d, c.attention_bias, dtype, device)
        self.k_proj = _Linear(h, self.kv_heads * d, c.attention_bias, dtype, device)
        self.v_proj = _Linear(h, self.kv_heads * d, c.attention_bias, dtype, device)
        self.o_proj = _row_linear(c.num_heads * d, h, dtype, device, c.row_segments, tp)
        self.rope_positions: int | None = None  # a bound on positions (set_max_positions): no device read-back
        self.qkv_fused: _FusedRows | None = None  # fuse_projections(): q/k/v as views of one weight
        if c.qk_norm:
            self.q_norm = _Norm(d, c.rms_norm_eps, dtype, device)
            self.k_norm = _Norm(d, c.rms_norm_eps, dtype, device)

    def fuse(self) -> bool:
        if self.q_proj.bias is None and self.qkv_fused is None:  # biased projections stay three GEMMs
            self.qkv_fused = _FusedRows((self.q_proj, self.k_proj, self.v_proj), ("q_proj", "k_proj", "v_proj"))
        return self.qkv_fused is not None

    def forward(self, x, positions, attend: Attend, layer: int):
        c, t = self.c, x.shape[0]
        if self.qkv_fused is not None and self.qkv_fused.ok():
            # strided views of one output: the ops below take strides
            q, k, v = self.qkv_fused(x).split(self.qkv_fused.sizes, dim=1)
            q = q.reshape(t, self.heads, c.head_dim)
            k, v = k.reshape(t, self.kv_heads, c.head_dim), v.reshape(t, self.kv_heads, c.head_dim)
        else:
            q = self.q_proj(x).reshape(t, self.heads, c.head_dim)
            k = self.k_proj(x).reshape(t, self.kv_heads, c.head_dim)
            v = self.v_proj(x).reshape(t, self.kv_heads, c.head_dim)
        bound = self.rope_positions
        if c.qk_norm and self.qkv_fused is not None and not _hooked(self.q_norm, self.k_norm):
            # the engine layout: each head norm and its rotation as one op (one launch on CUDA, no copy of the view)
            qn, kn = self.q_norm, self.k_norm
            q = rms_norm_rope(q, qn.weight, qn.eps, positions, c.rope_theta, max_position=bound)
            k = rms_norm_rope(k, kn.weight, kn.eps, positions, c.rope_theta, max_position=bound)
        else:
            if c.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q = rope(q, positions, c.rope_theta, max_position=bound)
            k = rope(k, positions, c.rope_theta, max_position=bound)
        out = attend(layer, q, k, v)
        return self.o_proj(out.reshape(t, self.heads * c.head_dim))


class _MLP(nn.Module):
    def __init__(self, c: DecoderConfig, dtype, device, tp: TensorParallel | None = None):
        super().__init__()
        inter = _split(c.intermediate_size, tp, "intermediate_size")
        self.gate_proj = _Linear(c.hidden_size, inter, False, dtype, device)
        self.up_proj = _Linear(c.hidden_size, inter, False, dtype, device)
        self.down_proj = _row_linear(c.intermediate_size, c.hidden_size, dtype, device, c.row_segments, tp)
        self.gate_up_fused: _FusedRows | None = None  # fuse_projections(): gate/up as views of one weight

    def fuse(self) -> bool:
        if self.gate_up_fused is None:
            self.gate_up_fused = _FusedRows((self.gate_proj, self.up_proj), ("gate_proj", "up_proj"))
        return True

    def forward(self, x):
        fused = self.gate_up_fused
        if fused is not None and fused.ok():
            if not _hooked(fused):  # no hook wants gate/up: the GEMM and swiglu as one op (a fusion where one is registered)
                return self.down_proj(linear_swiglu(x, fused.weight_rows))
            gate, up = fused(x).split(fused.sizes, dim=1)
            return self.down_proj(swiglu(gate, up))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class _Layer(nn.Module):
    def __init__(self, c: DecoderConfig, dtype, device, tp: TensorParallel | None = None):
        super().__init__()
        self.input_layernorm = _Norm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = _Attention(c, dtype, device, tp)
        self.post_attention_layernorm = _Norm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = _MLP(c, dtype, device, tp)
        self.fused_residual = False  # fuse_projections(): the residual adds inside the norms (forward_fused)

    def forward(self, x, positions, attend, layer):
        # HF order: residual adds in the activation dtype, each norm reads the sum.
        x = x + self.self_attn(self.input_layernorm(x), positions, attend, layer)
        return x + self.mlp(self.post_attention_layernorm(x))

    def can_fuse_residuals(self) -> bool:
        """`forward_fused` may serve this call: the layout asks for it (fuse_projections), no hook on the layer or its
        norms wants the values in between, and no gradient is wanted."""
        return self.fused_residual and not torch.is_grad_enabled() and not _hooked(
            self, self.input_layernorm, self.post_attention_layernorm)

    def forward_fused(self, x, pending, positions, attend, layer):
        """`forward` with each residual add inside the norm that reads the sum (`rms_norm(residual=)`: the add in the
        activation dtype, the same sum as `x + a`, IEEE addition commutes): takes the residual stream x and the previous
        layer's MLP output not yet added (None: nothing pending), returns the stream after the attention's add and this
        layer's MLP output, pending for the next norm. The same bits as `forward`, two launches fewer."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm(pending, residual=x)
        h, x = self.post_attention_layernorm(self.self_attn(h, positions, attend, layer), residual=x)
        return x, self.mlp(h)


class StrictDecoder(nn.Module):
    """The decoder; parameters named as in HF `Qwen3ForCausalLM` / `LlamaForCausalLM`."""

    def __init__(self, config: DecoderConfig, *, dtype=torch.float32, device="cpu", tp: TensorParallel | None = None):
        super().__init__()
        self.config = c = config
        self.tp = tp if tp is not None and tp.world > 1 else None
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.model.layers = nn.ModuleList(_Layer(c, dtype, device, self.tp) for _ in range(c.num_layers))
        self.model.norm = _Norm(c.hidden_size, c.rms_norm_eps, dtype, device)
        if not c.tie_word_embeddings:
            self.lm_head = _Linear(c.hidden_size, c.vocab_size, False, dtype, device)

    def fuse_projections(self) -> int:
        """Lay out each layer's q/k/v and gate/up weights as views of one weight and run each group as one GEMM (a
        rollout engine's layout: fewer launches, wider tiles). The same bits as the separate GEMMs, the same parameter
        names and values; weights loaded or copied in place afterwards land in the fused weight. A call that wants
        gradients for these parameters, or finds a parameter moved off the fused storage, runs the separate GEMMs.
        Also in this layout: gate/up's GEMM and swiglu as one op (`rk.linear_swiglu`), Qwen3's head norm and RoPE as
        one op (`rk.rms_norm_rope`), and each residual add inside the norm that reads the sum (`rms_norm(residual=)`:
        `_Layer.forward_fused`), each where no hook wants the values in between and no gradient is wanted (one launch
        each where the backend registers a fusion: on CUDA norm + RoPE and the residual adds; the SwiGLU epilogue is
        off, `contracts.gpu.SWIGLU_EPILOGUE`). Returns the number of groups fused."""
        for layer in self.model.layers:
            layer.fused_residual = True
        return sum(int(layer.self_attn.fuse()) + int(layer.mlp.fuse()) for layer in self.model.layers)

    def set_max_positions(self, n: int | None) -> None:
        """Bound every position this model will see (an engine's max_model_len): RoPE then sizes
        its table from the bound instead of reading the positions back from the device, which
        keeps a GPU decode step free of host syncs (and CUDA-graph capturable)."""
        for layer in self.model.layers:
            layer.self_attn.rope_positions = None if n is None else int(n)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Final-normed hidden states [T, H] of a flat token batch."""
        bound = self.model.layers[0].self_attn.rope_positions if len(self.model.layers) else None
        if bound is not None:  # one bound check for the forward, not one per rope call (2 a layer)
            positions = checked_below(positions, bound)
        x = self.model.embed_tokens(input_ids)
        pending = None  # a layer's MLP output not yet added to x: the next norm adds it (Layer.forward_fused)
        for i, layer in enumerate(self.model.layers):
            if layer.can_fuse_residuals():
                x, pending = layer.forward_fused(x, pending, positions, attend, i)
                continue
            if pending is not None:
                x, pending = x + pending, None
            x = layer(x, positions, attend, i)
        norm = self.model.norm
        if pending is None:
            return norm(x)
        if _hooked(norm):
            return norm(x + pending)
        return norm(pending, residual=x)[0]

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """float32 log p(targets | hidden) under the strict linear-logprob contract."""
        return linear_logprob(hidden, self.lm_head_weight, targets, temperature, vocab_size=self.config.vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits (diagnosis and tests only; the strict path never needs them)."""
        return linear(hidden, self.lm_head_weight[: self.config.vocab_size])

    def forward_packed(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Hidden states of packed whole sequences (training-style full-sequence forward)."""
        positions = _positions(cu_seqlens, input_ids.device)
        return self.hidden_states(input_ids, positions, lambda _, q, k, v: attention_varlen(q, k, v, cu_seqlens))

    def score(self, sequences: Sequence[Sequence[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """For each sequence, float32 log p(token t | tokens < t) for t = 1..len-1."""
        ids, cu = pack_sequences(sequences, self.model.embed_tokens.weight.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"score: token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        hidden = self.forward_packed(ids, cu)
        keep = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
        keep[cu[1:] - 1] = False  # the last token of each sequence predicts nothing
        lp = self.logprobs(hidden[keep], ids[torch.roll(keep, 1)], temperature)
        return list(lp.split([max(len(s) - 1, 0) for s in sequences]))

    @torch.no_grad()
    def load_hf_weights(self, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy HF-named tensors in place; with strict, missing or unknown names raise."""
        own = dict(self.named_parameters())
        tensors = {k: v for k, v in tensors.items() if not (self.config.tie_word_embeddings and k == "lm_head.weight")}
        unknown, missing = sorted(set(tensors) - set(own)), sorted(set(own) - set(tensors))
        if strict and (unknown or missing):
            raise KeyError(f"weights do not match the model: unknown {unknown[:5]}, missing {missing[:5]}")
        for name, value in tensors.items():
            if name in own:
                value = self._shard(name, value, own[name].shape)
                if own[name].shape != value.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(own[name].shape)}")
                own[name].copy_(value)

    _SHARD_DIMS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}

    def _shard(self, name: str, value: torch.Tensor, local_shape) -> torch.Tensor:
        """Under tensor parallelism, this rank's contiguous slice of a full HF tensor (heads / MLP rows, or the
        row-parallel linears' K-columns); anything else unchanged."""
        if self.tp is None or value.shape == local_shape:
            return value
        dim = next((d for key, d in self._SHARD_DIMS.items() if f".{key}." in name), None)
        if dim is None or value.dim() <= dim or value.shape[dim] != local_shape[dim] * self.tp.world:
            return value  # the shape check then names the mismatch
        n = local_shape[dim]
        return value.narrow(dim, self.tp.rank * n, n)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype=torch.float32, device="cpu", row_segments: int | None = None) -> "StrictDecoder":
        """Load a local HF checkpoint directory (config.json + *.safetensors); row_segments: the canonical K segments
        (None: DecoderConfig's default)."""
        import json
        from pathlib import Path

        from safetensors.torch import load_file

        root = Path(path)
        config = DecoderConfig.from_hf(json.loads((root / "config.json").read_text()))
        if row_segments is not None:
            config = dataclasses.replace(config, row_segments=int(row_segments))
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {root}")
        model = cls(config, dtype=dtype, device=device)
        tensors = {}
        for f in files:
            tensors.update(load_file(str(f), device=str(device)))
        model.load_hf_weights(tensors)
        return model


def _positions(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return torch.cat([torch.arange(n, device=device) for n in lens]) if lens else torch.zeros(0, dtype=torch.long, device=device)


def pack_sequences(sequences: Sequence[Sequence[int]], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(flat int64 ids, cu_seqlens int64 [B+1]) of a list of token-id lists."""
    if any(len(s) == 0 for s in sequences):
        raise ValueError("pack_sequences: empty sequence")
    ids = torch.tensor([t for s in sequences for t in s])  # its dtype inferred: a float id must not be truncated
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"pack_sequences: token ids must be ints, got {ids.dtype} values")
    ids = ids.to(device=device, dtype=torch.long)
    cu = torch.tensor([0] + [len(s) for s in sequences], device=device).cumsum(0)
    return ids, cu

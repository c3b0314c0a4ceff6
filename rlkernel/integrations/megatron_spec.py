"""Megatron-core GPTModel whose every numerical op is an rlkernel op: the layer spec and the model.

What this module decides: how Megatron's `GPTModel` is made to compute exactly the
function of `rlkernel.models.StrictDecoder` (same ops, same partitions, same rounding
points), using only Megatron's extension points, no patching:

* A `TransformerLayer` `ModuleSpec` whose submodules are ours: `StrictRMSNorm`
  (input/pre-MLP norms and Qwen3's per-head q/k norms, `rk.rms_norm`), column- and
  row-parallel linears with Megatron's linear interface (`forward -> (out, bias)`),
  `StrictCoreAttention` (RoPE inside it: `rk.rope` at positions derived from the packed
  `cu_seqlens`, then `rk.attention_varlen`), and `StrictMLP` (`rk.swiglu` on the
  `[gate_local; up_local]` halves of fc1: Megatron's MLP would compute act(gate) * up
  itself, with its own rounding).
* `position_embedding_type="none"`: Megatron's RotaryEmbedding needs CUDA and would
  round its table differently; RoPE is the core attention's job here.
* Column-parallel linears compute their local shard with `rk.linear` (the strict GEMM is
  column invariant, so a fused QKV / fc1 shard gives the bits of separate q/k/v, gate/up
  GEMMs). Their input gradient is the canonical tree over S output-row segments
  (`rlkernel.parallel.tp_backward`, TP_BACKWARD_REFERENCE), so the backward is TP invariant
  too; likewise the logprob head's dL/dhidden (vocab segments) and the per-head q/k-norm
  weight gradients (`StrictHeadRMSNorm`). Under a native "linear" policy:
  `copy_to_tensor_model_parallel_region` (Megatron's all-reduce of the input gradient).
* Row-parallel linears (o_proj, down_proj) reduce over *canonical K-segments*: with
  S = canonical_segments(K_full, row_segments) each rank computes the float32 partials of
  its S/tp segments and `rk.tree_all_reduce` merges all S by one fixed tree, then one cast
  to the activation dtype: bitwise `rk.linear(x, w_full, k_segments=S)` for every TP size
  dividing S. Under a native "linear" policy: F.linear and Megatron's all-reduce.
* GPTModel is built with `post_process=False` (its output layer is a hard-coded
  ColumnParallelLinear that materialises full logits, and its loss is Megatron's CE):
  `StrictGPTModel` owns the final norm and `StrictLogprobHead`, which returns
  selected-token logprobs via `rk.linear_logprob` (TP=1) or the vocab-parallel op
  (TP>1; with gradients at every TP size). At TP>1 the vocab is padded to S_v canonical
  segments of whole VOCAB_TILEs (the same segments as TP=1); padded rows are never read. Embeddings are tied by the head reading the embedding weight.
* Only the packed `thd` layout is supported (that is what scoring and training feed).

Megatron param attributes (`tensor_model_parallel`, `partition_dim`,
`partition_stride`) are set on our params so Megatron's DDP / optimizer and our
converter (`megatron_convert`) see the layout. Process groups come from
`megatron.core.parallel_state`, which must be initialised before building.
"""
from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

import rlkernel as rk
from rlkernel.models.decoder import DecoderConfig
from rlkernel.ops.linear import canonical_segments
from rlkernel.parallel import vocab_parallel_logprob_fn
from rlkernel.parallel import token_segments
from rlkernel.parallel.context_parallel import cp_attention
from rlkernel.backends.reference.norm import weight_grad_reducer
from rlkernel.backends.reference.rope import mark_below
from rlkernel.parallel.tp_backward import ColumnParallelLinearFn, RowParallelLinearFn, head_segment_weight_grad

# (offset, CP group) while a context-parallel forward runs (StrictGPTModel.hidden_states sets it for StrictCoreAttention)
_CP: contextvars.ContextVar = contextvars.ContextVar("rlkernel_megatron_cp", default=None)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronSpecConfig:
    decoder: DecoderConfig  # the model (and its row_segments): the same object StrictDecoder takes
    tp: int = 1  # tensor-parallel size; must equal parallel_state's
    dtype: str = "float32"  # params and activations: "float32" or "bfloat16"
    max_sequence_length: int = 4096  # Megatron bookkeeping only (no position table is built)
    # whether the q/k-norm weight gradients leave their layer summed over TP already (StrictHeadRMSNorm under a strict
    # rms_norm policy): then Megatron's finalize_model_grads must not sum them again (its qk_layernorm flag is off)
    qk_norm_grads_summed: bool = True

    def __post_init__(self):
        d = self.decoder
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.tp < 1 or d.num_heads % self.tp or d.num_kv_heads % self.tp:
            raise ValueError(f"tp={self.tp} must divide heads {d.num_heads} and kv heads {d.num_kv_heads} (kv heads < tp needs CUDA paths)")
        if d.intermediate_size % self.tp:
            raise ValueError(f"tp={self.tp} must divide intermediate_size {d.intermediate_size}")
        q_rows = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim
        for name, k in (("o_proj", d.num_heads * d.head_dim), ("down_proj", d.intermediate_size), ("qkv rows", q_rows),
                        ("gate/up rows", d.intermediate_size), ("q-norm heads", d.num_heads), ("k-norm heads", d.num_kv_heads),
                        ("vocab segments", 1 << 30)):
            s = canonical_segments(k, d.row_segments)
            if s % self.tp:
                raise ValueError(f"{name}: {s} canonical segments (of {k}, row_segments={d.row_segments}) are not divisible by tp={self.tp}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def vocab_segments(self) -> int:
        """S_v: canonical vocab segments (the largest power of two <= row_segments), the same at every TP size."""
        return canonical_segments(1 << 30, self.decoder.row_segments)

    @property
    def vocab_segment_rows(self) -> int:
        """Rows per canonical vocab segment: a whole number of VOCAB_TILEs, independent of TP."""
        tiles = -(-self.decoder.vocab_size // rk.VOCAB_TILE)
        return -(-tiles // self.vocab_segments) * rk.VOCAB_TILE

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding / lm_head: the true vocab at TP=1; at TP>1 S_v whole segments (so every shard is
        S_v/tp segments of whole VOCAB_TILEs, and the segments are those of TP=1)."""
        if self.tp == 1:
            return self.decoder.vocab_size
        return self.vocab_segments * self.vocab_segment_rows

    def transformer_config(self) -> TransformerConfig:
        d, dt = self.decoder, self.torch_dtype
        return TransformerConfig(
            num_layers=d.num_layers, hidden_size=d.hidden_size, num_attention_heads=d.num_heads,
            num_query_groups=d.num_kv_heads, kv_channels=d.head_dim, ffn_hidden_size=d.intermediate_size,
            gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=d.rms_norm_eps,
            qk_layernorm=d.qk_norm and not self.qk_norm_grads_summed, add_bias_linear=False, add_qkv_bias=d.attention_bias,
            hidden_dropout=0.0, attention_dropout=0.0,  # Megatron defaults to 0.1
            bias_dropout_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, gradient_accumulation_fusion=False,
            use_cpu_initialization=True,  # the CUDA init path forks the CUDA RNG tracker
            params_dtype=dt, bf16=dt == torch.bfloat16, tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=1, sequence_parallel=False, init_method_std=0.02,
        )


def _init_shard(weight, full_shape, dim, stride, init_method, rank, world):
    """Initialise a full master weight on the CPU RNG and keep this rank's stride chunks (Megatron's CPU layout)."""
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    chunks = master.chunk(stride * world, dim=dim)
    with torch.no_grad():
        weight.copy_(torch.cat(chunks[rank::world], dim=dim).to(weight.dtype))


class StrictRMSNorm(torch.nn.Module):
    """RMSNorm for Megatron's norm slots (layer, final, q/k): `rk.rms_norm` over the last dim."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps

    def forward(self, x):
        state = token_segments.current() if torch.is_grad_enabled() else None
        if state is None or rk.current_policy().choice("rms_norm") == "native":
            return rk.rms_norm(x, self.weight, self.eps)
        with weight_grad_reducer(token_segments.weight_reducer(self.weight, state)):  # per token segment, deposited
            return rk.rms_norm(x, self.weight, self.eps)


class StrictHeadRMSNorm(StrictRMSNorm):
    """Qwen3's per-head q/k norm (one [head_dim] weight shared by every head): rk.rms_norm over the last dim, with the
    weight's gradient summed over S_h canonical head segments by one tree across the TP group (TP_BACKWARD_REFERENCE),
    so every rank holds the full, TP-invariant gradient. Under a native rms_norm policy: one call, the trainer
    all-reduces the gradient as Megatron would."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, *, row_segments: int, **_unused):
        super().__init__(config, hidden_size, eps)
        self.row_segments = row_segments
        self.tp_group = parallel_state.get_tensor_model_parallel_group()

    def forward(self, x):
        if rk.current_policy().choice("rms_norm") == "native" or not torch.is_grad_enabled():
            return rk.rms_norm(x, self.weight, self.eps)
        world, heads = self.tp_group.size(), x.shape[-2]
        n = canonical_segments(heads * world, self.row_segments) // world
        reduce = head_segment_weight_grad(heads, n, self.tp_group, self.weight.dtype)
        state = token_segments.current()
        if state is not None:  # token segments: that reduction per token segment, deposited (token_segments.py)
            reduce = token_segments.weight_reducer(self.weight, state, base=reduce)
        with weight_grad_reducer(reduce):
            return rk.rms_norm(x, self.weight, self.eps)  # one call; the weight gradient per head segment, then one tree


class StrictColumnParallelLinear(torch.nn.Module):
    """ColumnParallelLinear's interface (gather_output=False): y_local = rk.linear(x, w_local)."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, gather_output=False, stride=1,
                 skip_bias_add=False, tp_group=None, row_segments: int, **_unused):
        super().__init__()
        if gather_output:
            raise ValueError("StrictColumnParallelLinear: gather_output is not supported (outputs stay sharded)")
        self.tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        world, rank = self.tp_group.size(), self.tp_group.rank()
        # canonical segments of the output rows (TP_BACKWARD_REFERENCE): the input gradient is their tree
        segments = canonical_segments(output_size // stride, row_segments)
        if segments % world:
            raise ValueError(f"column-parallel N={output_size}: {segments} canonical segments not divisible by tp={world}")
        self.segments, self.stride = segments // world, stride
        self.weight = torch.nn.Parameter(torch.empty(output_size // world, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            _init_shard(self.weight, (output_size, input_size), 0, stride, init_method, rank, world)
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        self.weight.rk_segments = ("chunks", 0, stride, self.segments)
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size // world, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            self.bias.rk_segments = ("chunks", 0, stride, self.segments)
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = False

    def forward(self, x, weight=None, runtime_gather_output=None):
        w = self.weight if weight is None else weight
        bias = None if self.skip_bias_add else self.bias
        if rk.current_policy().choice("linear") == "native":
            if self.tp_group.size() > 1:
                x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)  # backward: Megatron's all-reduce of dgrad
            y = rk.linear(x, w, bias)
        else:  # strict: dX is the canonical tree over every rank's output-row segments (TP invariant)
            y = ColumnParallelLinearFn.apply(x, w, bias, self.tp_group, self.segments, self.stride)
        return y, (self.bias if self.skip_bias_add else None)


class StrictRowParallelLinear(torch.nn.Module):
    """RowParallelLinear's interface (input_is_parallel=True), reduced over canonical K-segments."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=False, input_is_parallel=True,
                 skip_bias_add=False, stride=1, tp_group=None, row_segments: int, **_unused):
        super().__init__()
        if not input_is_parallel or bias:
            raise ValueError("StrictRowParallelLinear: needs input_is_parallel=True and no bias (Qwen3/Llama)")
        self.tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        world, rank = self.tp_group.size(), self.tp_group.rank()
        self.segments = canonical_segments(input_size, row_segments)
        if self.segments % world:
            raise ValueError(f"row-parallel K={input_size}: {self.segments} canonical segments not divisible by tp={world}")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size // world, dtype=config.params_dtype))
        if config.perform_initialization:
            _init_shard(self.weight, (output_size, input_size), 1, stride, init_method, rank, world)
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        self.weight.rk_segments = ("chunks", 1, 1, self.segments // world)
        self.bias = None
        self.sequence_parallel = False

    def forward(self, x):
        world = self.tp_group.size()
        if rk.current_policy().choice("linear") == "native":
            y = rk.linear(x, self.weight)  # dispatches to F.linear (and records provenance)
            return (reduce_from_tensor_model_parallel_region(y, group=self.tp_group) if world > 1 else y), None
        y = RowParallelLinearFn.apply(x.reshape(-1, x.shape[-1]), self.weight, self.tp_group, self.segments // world)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1]), None


class StrictCoreAttention(torch.nn.Module):
    """Core attention for packed (thd) q [T, Hq, D], k/v [T, Hkv, D]: RoPE, then rk.attention_varlen."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, *, rope_theta: float, **_unused):
        super().__init__()
        self.rope_theta = rope_theta
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("StrictCoreAttention: only packed sequences (PackedSeqParams qkv_format='thd') are supported")
        cu = packed_seq_params.cu_seqlens_q
        cp = _CP.get()
        if cp is not None:  # this CP rank holds tokens [offset, offset + T_local) of the stream cu describes
            offset, group = cp
            total = query.shape[0] * group.size()  # the stream, padded to cp x T_local
            pos = positions_from_cu_seqlens(cu, query.device, total)[offset:offset + query.shape[0]]
            bound = offset + query.shape[0]  # a token's position is at most its index in the stream: no read-back
            q, k = rk.rope(query, pos, self.rope_theta, max_position=bound), rk.rope(key, pos, self.rope_theta, max_position=bound)
            out = cp_attention(q, k, value, cu, offset, group, scale=self.softmax_scale)
            return out.reshape(out.shape[0], -1)
        pos = positions_from_cu_seqlens(cu, query.device, query.shape[0])
        # positions are below the stream's length: the table is sized from it, not from pos.max() read back (a host sync
        # per call, two a layer); the table's rows do not depend on its size (rope_table), so neither do the bits
        q = rk.rope(query, pos, self.rope_theta, max_position=query.shape[0])
        k = rk.rope(key, pos, self.rope_theta, max_position=query.shape[0])
        # the longest sequence as the host knows it (hidden_states reads it once a forward): no read-back a layer
        out = rk.attention_varlen(q, k, value, cu, scale=self.softmax_scale, max_seqlen=packed_seq_params.max_seqlen_q)
        return out.reshape(out.shape[0], -1)


class StrictMLP(MegatronModule):
    """SwiGLU MLP: fc1 (column, [gate_local; up_local]) -> rk.swiglu -> fc2 (row, canonical segments)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, tp_group=None, **_unused):
        super().__init__(config=config)
        ffn = config.ffn_hidden_size
        common = dict(config=config, bias=False, skip_bias_add=True, is_expert=False, tp_group=tp_group)
        self.linear_fc1 = build_module(submodules.linear_fc1, config.hidden_size, 2 * ffn, init_method=config.init_method,
                                       gather_output=False, tp_comm_buffer_name="fc1", stride=2, **common)
        self.linear_fc2 = build_module(submodules.linear_fc2, ffn, config.hidden_size, init_method=config.output_layer_init_method,
                                       input_is_parallel=True, tp_comm_buffer_name="fc2", **common)

    def forward(self, hidden_states, per_token_scale=None, **_unused):
        inter, _ = self.linear_fc1(hidden_states)
        gate, up = inter.chunk(2, dim=-1)
        return self.linear_fc2(rk.swiglu(gate, up))


_POSITIONS: list = [None]  # (cu_seqlens, its version, device, total, positions): every layer of a forward asks for the same


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, device=None, total: int | None = None) -> torch.Tensor:
    """int64 position of every packed token inside its own sequence. `total` (= cu_seqlens[-1], when the caller knows
    it) spares the two host read-backs; the last stream's positions are kept, so the layers of one forward compute them
    once (the cache holds the cu_seqlens tensor itself, so its identity cannot be reused while cached)."""
    hit = _POSITIONS[0]
    if hit is not None and hit[0] is cu_seqlens and hit[1] == cu_seqlens._version and hit[2] == device and hit[3] == total:
        return hit[4]
    cu = cu_seqlens.long().to(device)
    lens = cu[1:] - cu[:-1]
    n = int(cu[-1]) if total is None else int(total)
    pos = torch.arange(n, device=cu.device) - torch.repeat_interleave(cu[:-1], lens, output_size=n)
    mark_below(pos, n)  # a position is below its sequence's length, below the stream's: rope needs no device check
    _POSITIONS[0] = (cu_seqlens, cu_seqlens._version, device, total, pos)
    return pos


def layer_spec(cfg: MegatronSpecConfig) -> ModuleSpec:
    """The TransformerLayer spec: every submodule an rlkernel-backed module."""
    d = cfg.decoder
    row = ModuleSpec(module=StrictRowParallelLinear, params={"row_segments": d.row_segments})
    column = ModuleSpec(module=StrictColumnParallelLinear, params={"row_segments": d.row_segments})
    head_norm = ModuleSpec(module=StrictHeadRMSNorm, params={"row_segments": d.row_segments})
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=StrictRMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=column,
                    core_attention=ModuleSpec(module=StrictCoreAttention, params={"rope_theta": d.rope_theta}),
                    linear_proj=row,
                    q_layernorm=head_norm if d.qk_norm else None,
                    k_layernorm=head_norm if d.qk_norm else None,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=StrictRMSNorm,
            mlp=ModuleSpec(module=StrictMLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


class StrictLogprobHead(torch.nn.Module):
    """The output layer as a selected-token logprob op (never full logits on the strict path).

    weight: this rank's [padded_vocab / tp, H] rows; None when tied (the caller passes the
    embedding's shard)."""

    def __init__(self, cfg: MegatronSpecConfig, tp_group, tied: bool):
        super().__init__()
        self.vocab_size, self.tp_group = cfg.decoder.vocab_size, tp_group
        self.shard = cfg.padded_vocab // cfg.tp
        self.segment_rows = cfg.vocab_segment_rows
        self.weight = None
        if not tied:
            self.weight = torch.nn.Parameter(torch.empty(self.shard, cfg.decoder.hidden_size, dtype=cfg.torch_dtype))
            world, rank = tp_group.size(), tp_group.rank()
            init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
            _init_shard(self.weight, (cfg.padded_vocab, cfg.decoder.hidden_size), 0, 1, init, rank, world)
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
            self.weight.rk_segments = ("rows", self.segment_rows, cfg.vocab_segments // world)

    def forward(self, hidden, targets, temperature: float, weight=None):
        w = self.weight if weight is None else weight
        world, rank = self.tp_group.size(), self.tp_group.rank()
        wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or w.requires_grad)
        strict = rk.current_policy().choice("linear_logprob") != "native"
        if wants_grad and strict:  # at every TP size: dL/dhidden over the canonical vocab segments (TP invariant)
            return vocab_parallel_logprob_fn(hidden, w, targets.long(), rank * self.shard, self.vocab_size, float(temperature), self.tp_group,
                                             self.segment_rows)
        if world == 1:
            return rk.linear_logprob(hidden, w, targets, temperature, vocab_size=self.vocab_size)
        start = rank * self.shard
        if rk.current_policy().choice("linear_logprob") == "native":
            # Megatron's vocab-parallel CE over full float32 logits; padded columns masked out.
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)  # backward: all-reduce dhidden (Megatron's output layer)
            logits = rk.linear(hidden, w, backend="native").float() / temperature  # the production GEMM (backends/native)
            pad = torch.arange(start, start + self.shard, device=hidden.device) >= self.vocab_size
            logits = logits.masked_fill(pad, -math.inf)
            return -vocab_parallel_cross_entropy(logits[:, None], targets[:, None])[:, 0]
        return rk.vocab_parallel_logprob(hidden, w, targets, vocab_start=start, vocab_size=self.vocab_size,
                                         temperature=temperature, group=self.tp_group, check=False)  # start = rank * shard


class StrictGPTModel(MegatronModule):
    """GPTModel (embedding + decoder, our spec) + our final norm + our logprob head."""

    def __init__(self, cfg: MegatronSpecConfig):
        tc = cfg.transformer_config()
        super().__init__(config=tc)
        self.spec_config = cfg
        d = cfg.decoder
        self.gpt = GPTModel(
            config=tc,
            transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[layer_spec(cfg)] * d.num_layers, layer_norm=StrictRMSNorm),
            vocab_size=cfg.padded_vocab, max_sequence_length=cfg.max_sequence_length,
            pre_process=True, post_process=False, share_embeddings_and_output_weights=False,
            position_embedding_type="none",
        )
        self.final_layernorm = StrictRMSNorm(tc, d.hidden_size, d.rms_norm_eps)
        self.output_layer = StrictLogprobHead(cfg, parallel_state.get_tensor_model_parallel_group(), d.tie_word_embeddings)
        world = parallel_state.get_tensor_model_parallel_world_size()
        self.gpt.embedding.word_embeddings.weight.rk_segments = ("rows", cfg.vocab_segment_rows, cfg.vocab_segments // world)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.gpt.embedding.word_embeddings.weight if self.spec_config.decoder.tie_word_embeddings else self.output_layer.weight

    def hidden_states(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cp: tuple | None = None,
                      max_seqlen: int | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, H] of packed whole sequences (flat ids [T], cu_seqlens [B+1]). Under context
        parallelism `cp` = (offset, group): input_ids are this rank's tokens [offset, offset + len) of the stream
        cu_seqlens describes, and the hidden states are theirs (rlkernel.parallel.context_parallel). max_seqlen: a
        bound >= the longest sequence when the caller knows it on the host (else read back from cu_seqlens)."""
        cu = cu_seqlens.to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max()) if max_seqlen is None else int(max_seqlen)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest)
        segmented = token_segments.current() is not None and torch.is_grad_enabled()
        if segmented and cp is None:  # a token-segmented backward runs attention by pieces at CP=1 too (CPAttention), in
            cp = (0, parallel_state.get_context_parallel_group())  # Megatron's one-rank CP group (never the default group)
        token = _CP.set(cp) if cp is not None else None
        try:
            if segmented:  # the embedding's gradient per token segment too (Megatron's lookup, done here: exact)
                tp = parallel_state.get_tensor_model_parallel_group()
                w = self.gpt.embedding.word_embeddings.weight
                emb = token_segments.embedding(w, input_ids, vocab_start=tp.rank() * w.shape[0], group=tp)
                h = self.gpt(None, None, None, decoder_input=emb[:, None], packed_seq_params=psp)
            else:
                h = self.gpt(input_ids[None], None, None, packed_seq_params=psp)  # [T, 1, H]
        finally:
            if token is not None:
                _CP.reset(token)
        return self.final_layernorm(h[:, 0])

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """float32 log p(targets | hidden) under the linear-logprob contract (vocab-parallel at TP>1)."""
        return self.output_layer(hidden, targets, temperature, weight=self.output_weight)


def build_model(cfg: MegatronSpecConfig) -> StrictGPTModel:
    """Build on the CPU (Megatron's CPU initialisation); parallel_state must match cfg.tp."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_model: initialise megatron.core.parallel_state first")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp != cfg.tp:
        raise ValueError(f"build_model: config tp={cfg.tp} but parallel_state has tp={tp}")
    return StrictGPTModel(cfg)

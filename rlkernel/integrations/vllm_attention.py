"""The strict attention backend for vLLM: rlkernel owns the KV-cache write and read.

What this module decides: how vLLM's paged KV cache is written and read on the
strict path. vLLM hands each layer one cache view [num_blocks, kv_heads,
block_size, 2*head_dim]; we read it as K then V halves of every (block, head)
page (the CPU backend's own convention, so the allocation is unchanged) and
compute with `rlkernel.attention_paged`, whose bits equal the trainer's packed
prefill. The metadata builder keeps vLLM's fields (block_table, seq_lens,
query_start_loc, slot_mapping) and skips the CPU kernel's scheduler metadata,
which rejects small head sizes and is not ours to depend on.

Models select the backend per layer (`Attention(..., attn_backend=...)`) —
the CPU platform ignores a global backend choice. On GPUs the same impl needs
a CUDA metadata base class: that arrives with the Triton backend (untested here).
"""
from __future__ import annotations

from vllm.platforms import current_platform
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from ..ops.attention import attention_paged, write_kv_cache


class StrictAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        return CPUAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc,
            max_seq_len=cm.max_seq_len,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            scheduler_metadata=None,
            causal=True,
        )


class StrictAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # profiling run: no cache yet
            return output
        md = attn_metadata
        nb, hkv, bs, two_d = kv_cache.shape
        d = two_d // 2
        kc, vc = kv_cache.view(nb, hkv, 2 * bs, d).chunk(2, dim=2)  # [nb, Hkv, bs, D] each
        n = md.num_actual_tokens
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)  # [nb, bs, Hkv, D] views
        # exact copies; padded tokens carry PAD_SLOT_ID (-1) and are skipped
        write_kv_cache(key[:n], value[:n], kc, vc, md.slot_mapping[:n])
        num_reqs = md.seq_lens.shape[0]
        out = attention_paged(query[:n], kc, vc, md.block_table[:num_reqs],
                              md.seq_lens, md.query_start_loc[: num_reqs + 1], scale=self.scale,
                              max_query_len=md.max_query_len, max_seq_len=md.max_seq_len)
        output[:n] = out.to(output.dtype)
        return output


class StrictAttentionBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update = True  # forward() writes the cache itself

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size: the strict op has no kernel table

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]  # any block size: the strict op reads keys by position

    @staticmethod
    def get_impl_cls():
        return StrictAttentionImpl

    @staticmethod
    def get_builder_cls():
        return StrictAttentionMetadataBuilder


def strict_backend():
    """The backend class for this platform; raises where the strict path is not built yet."""
    if not current_platform.is_cpu():
        raise NotImplementedError(
            "rlkernel strict attention for vLLM is built for the CPU platform; the CUDA/ROCm path "
            "arrives with the Triton backend. Run vLLM on CPU, or use mode=native."
        )
    return StrictAttentionBackend

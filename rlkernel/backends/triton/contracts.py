"""The contract data the Triton kernels read: a view of `rlkernel/contracts/gpu.py`, the one
source (tile configs, split sizes, the (dtype, N, K) -> config function). Nothing is defined
here."""
from ...contracts.gpu import (  # noqa: F401
    ARCH, ATTENTION_TILES, BF16_GEMM, FP32_GEMM, LOGPROB_BF16, AttentionTiles, TileConfig, as_dict, attention_head_dim_ok, dtype_name,
    FIXUP_TILE, _fit_accumulators, fixup_config, gemm_class, gemm_config, logprob_config, segments_config, swiglu_config)

ATTENTION = ATTENTION_TILES  # the kernels' default attention tiles
AttentionContract = AttentionTiles  # older name, kept for the kernels' `config=` overrides

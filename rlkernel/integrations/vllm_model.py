"""vLLM model classes for Qwen3 and Llama that run rlkernel's strict decoder.

What this module decides: what vLLM executes when it loads a Qwen3ForCausalLM
or LlamaForCausalLM checkpoint with the plugin on. The class *is* a
`StrictDecoder` (same parameters, HF names, plain tensors — vLLM's own linear
layers repack their weights on CPU and would not be ours), plus one vLLM
`Attention` layer per decoder layer so vLLM keeps owning KV-cache allocation
and scheduling, with the strict backend doing the math.

Sampled-token logprobs: `compute_logits` returns the full-vocab float32
log-softmax at the rollout temperature from `rlkernel.linear_logprobs_full`,
and the engine runs at request temperature 1.0 with `logprobs_mode="raw_logits"`
(vLLM's V1 runner; the CPU) or, on vLLM's V2 runner (the CUDA default), with
"raw_logprobs" and the sampler wrapped by the model's own ModelState
(`vllm_compat.strict_model_state_cls`), so vLLM reports exactly those bits (any
further log_softmax or division by a temperature would change them) and samples
from softmax(z / T). A mode that would re-normalise them without the wrapper is
refused at the first `compute_logits`.

Plugin settings come from `additional_config={"rlkernel": {...}}`:
`temperature` (rollout temperature, default 1.0), `mode` and `ops` (an
rlkernel execution policy, for ablations).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn
from vllm.model_executor.layers.attention import Attention

from ..dispatch import ExecutionPolicy, ProvenanceCounter, mode
from ..models.decoder import DecoderConfig, StrictDecoder, TensorParallel
from ..ops.logprob import linear_logprobs_full
from .vllm_compat import strict_attention_backend, strict_model_state_cls


def plugin_settings(vllm_config) -> dict:
    extra = vllm_config.additional_config
    return dict(extra.get("rlkernel", {})) if isinstance(extra, dict) else {}


def _check_cache_dtype(vllm_config) -> None:
    """The strict KV cache holds the model's dtype (`write_kv_cache` copies exactly): a `kv_cache_dtype` naming another
    is refused here, when the engine is built, not at its first write (it once rounded k / v into the cache, so the
    rollout's logprobs were not the trainer's)."""
    cache = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto") or "auto")
    dtype = vllm_config.model_config.dtype
    if cache != "auto" and getattr(torch, cache, None) != dtype:
        raise ValueError(f"rlkernel strict model: kv_cache_dtype={cache!r} but the model runs {dtype}: the strict "
                         "attention's cache holds the model dtype (k / v are copied into it exactly); pass "
                         "kv_cache_dtype='auto'")


class StrictForCausalLM(StrictDecoder):
    """A StrictDecoder that vLLM can construct, feed and load."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        hf = vllm_config.model_config.hf_config
        settings = plugin_settings(vllm_config)
        config = DecoderConfig.from_hf(hf.to_dict())
        if "row_segments" in settings:  # the canonical K segments of the row-parallel layers: the trainer's (vime passes them)
            config = dataclasses.replace(config, row_segments=int(settings["row_segments"]))
        _check_cache_dtype(vllm_config)
        super().__init__(config, dtype=vllm_config.model_config.dtype, device=vllm_config.device_config.device, tp=_vllm_tp())
        self.set_max_positions(vllm_config.model_config.max_model_len)  # RoPE without reading positions back
        self._kernel_recorder = self.compile_ahead_stats = None
        manifest = settings.get("kernel_manifest")
        if manifest and torch.device(vllm_config.device_config.device).type == "cuda":
            # compile-ahead (rlkernel/backends/triton/precompile.py), before weights and graph capture launch anything:
            # TP rank 0 records into the manifest; at TP > 1 rank 0's worker processes compile it once into the shared
            # disk cache while the other ranks wait on vLLM's TP group (its CPU group), then every rank preloads
            from ..backends.triton import precompile

            world, rank = (1, 0) if self.tp is None else (self.tp.world, self.tp.rank)
            self._kernel_recorder, self.compile_ahead_stats = precompile.start_group(
                manifest, rank, world, _tp_barrier, workers=settings.get("compile_workers"), log=lambda m: print(m, flush=True),
                seed=settings.get("kernel_manifest_seed"), role="engine")
        # the engine layout: q/k/v and gate/up one GEMM each over views of one weight, gate/up + SwiGLU, head norm +
        # RoPE and each residual add + norm one op each (one launch on CUDA): the same bits
        self.fuse_projections()
        self.rollout_temperature = float(settings.get("temperature", 1.0))
        if not self.rollout_temperature > 0:
            raise ValueError(f"rlkernel rollout temperature must be > 0, got {self.rollout_temperature}")
        self.policy = ExecutionPolicy(mode=settings.get("mode", "strict"), ops=tuple(sorted(dict(settings.get("ops", {})).items())))
        self.weight_version = int(settings.get("weight_version", 0))
        # the reported logprobs are compute_logits' values only if vLLM reports raw logits, or its V2 runner's sampler
        # is wrapped by our ModelState (custom_sampler sets contract_sampler)
        self.logprobs_mode = getattr(vllm_config.model_config, "logprobs_mode", "raw_logits")
        self.contract_sampler = False
        self.contract_sampler_calls = 0
        self.provenance = ProvenanceCounter()  # per-op contract ids and call counts, taken per step
        backend = strict_attention_backend()
        world = 1 if self.tp is None else self.tp.world  # this rank's heads (vLLM's TP)
        self.attn = nn.ModuleList(
            Attention(config.num_heads // world, config.head_dim, config.head_dim**-0.5, num_kv_heads=config.num_kv_heads // world,
                      cache_config=vllm_config.cache_config, prefix=f"{prefix}rlkernel.layers.{i}.attn", attn_backend=backend)
            for i in range(config.num_layers)
        )

    def _policy(self):
        p = self.policy
        # weights change only through load_weights (in-place copies): packed weights are safe
        return mode(p.mode, impl=p.impl or "auto", ops=dict(p.ops), pack_weights=True)

    def _attend(self, layer: int, q, k, v):
        t, hq, d = q.shape
        return self.attn[layer](q.reshape(t, hq * d), k.reshape(t, -1), v.reshape(t, -1)).view(t, hq, d)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if intermediate_tensors is not None or inputs_embeds is not None:
            raise NotImplementedError("rlkernel strict models run without pipeline parallelism or input embeddings")
        with self._policy(), self.provenance.collect():
            return self.hidden_states(input_ids, positions.long(), self._attend)

    @staticmethod
    def get_model_state_cls():
        """vLLM's V2 model runner builds this model's ModelState from this class (the sampler wrapper)."""
        return strict_model_state_cls()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.logprobs_mode != "raw_logits" and not self.contract_sampler:
            raise RuntimeError(
                f"rlkernel strict model: logprobs_mode={self.logprobs_mode!r} without the contract sampler (vLLM's V1 "
                "model runner, or a V2 runner that did not build the model's ModelState) would report vLLM's own "
                "log-softmax of the contract's logprobs, not their bits. Run with logprobs_mode='raw_logits' on the V1 "
                "runner, or let vime choose (vllm_compat.contract_logprobs_mode).")
        with self._policy(), self.provenance.collect():
            return linear_logprobs_full(hidden_states, self.lm_head_weight, self.rollout_temperature, vocab_size=self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tensors = dict(weights)
        self.load_hf_weights(tensors)
        return {name for name, _ in self.named_parameters()}


def _vllm_tp():
    """vLLM's tensor-parallel group as rlkernel's TensorParallel (None at TP=1)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return None
    group = get_tp_group()
    # the row-parallel merges gather through vLLM's own communicator (pynccl / its custom all-gather on CUDA, which its
    # CUDA graphs capture; shared memory or gloo on the CPU): rank order, data only — the tree's bits
    return TensorParallel(rank=group.rank_in_group, world=world, group=group.device_group,
                          gather=lambda t: group.all_gather(t.unsqueeze(0), dim=0))


def _tp_barrier() -> None:
    """Wait for every rank of vLLM's tensor-parallel group (its gloo CPU group: no device work)."""
    from vllm.distributed import get_tp_group

    torch.distributed.barrier(group=get_tp_group().cpu_group)


class StrictQwen3ForCausalLM(StrictForCausalLM):
    pass


class StrictLlamaForCausalLM(StrictForCausalLM):
    pass

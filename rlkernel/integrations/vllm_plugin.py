"""vLLM general plugin entry point (`vllm.general_plugins` -> `register`): opt-in strict models.

What this module decides: the names under which vLLM can find rlkernel's strict model
classes, and that those names are *new* ones. vLLM loads every installed general plugin in
every process it starts, so registering over `Qwen3ForCausalLM` would silently change what a
plain `vllm serve` of a Qwen3 checkpoint runs in any environment where this package is
installed. Instead the strict classes are registered as `RlkernelStrictQwen3ForCausalLM` /
`RlkernelStrictLlamaForCausalLM`, and only an engine that asks for one — vime does, with
`hf_overrides={"architectures": [strict_architecture(...)]}` — loads it. Stock vLLM (vime's
native arm included) keeps vLLM's own classes. Idempotent and cheap.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# HF architecture -> the name the strict class is registered under (never an HF name)
STRICT_NAMES = {
    "Qwen3ForCausalLM": "RlkernelStrictQwen3ForCausalLM",
    "LlamaForCausalLM": "RlkernelStrictLlamaForCausalLM",
}
_CLASSES = {
    "RlkernelStrictQwen3ForCausalLM": "StrictQwen3ForCausalLM",
    "RlkernelStrictLlamaForCausalLM": "StrictLlamaForCausalLM",
}
_done = False


def strict_architecture(hf_architectures) -> str:
    """The registered strict name for a checkpoint's `architectures` (config.json); raises for
    an architecture rlkernel has no strict model of."""
    archs = [hf_architectures] if isinstance(hf_architectures, str) else list(hf_architectures or [])
    for arch in archs:
        if arch in STRICT_NAMES:
            return STRICT_NAMES[arch]
        if arch in _CLASSES:
            return arch
    raise ValueError(f"rlkernel has no strict vLLM model for architectures {archs}; supported: {sorted(STRICT_NAMES)}")


def register() -> None:
    global _done
    if _done:
        return
    from vllm import ModelRegistry

    from . import vllm_model

    for name, cls in _CLASSES.items():
        ModelRegistry.register_model(name, getattr(vllm_model, cls))
    _done = True
    log.info("rlkernel: strict models registered as %s (opt-in; HF architectures untouched)", ", ".join(_CLASSES))

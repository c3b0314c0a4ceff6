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
    init: str = "hf",
    device: str = "cpu",
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write config.json, the weights (safetensors) and the tokenizer under `out`; returns the path.

    init="hf": transformers' own model built and initialised (in float32, then cast), saved with `save_pretrained`:
    what the tests and recipes use. init="stream": the same files without building the model — each parameter drawn
    on its own (std `init_std` normal, norms 1 + 0.1 normal, as "hf" gives), tensors in parallel, written in shards
    of at most `max_shard_bytes` (with the index file `from_pretrained` and vLLM read): for checkpoints at real
    widths (a random Qwen3-8B for the GPU runs), where "hf" holds the whole model in float32 and draws it on one
    thread. Its weights are a function of (seed, parameter name, `device`): another draw than "hf"'s; `device`
    ("cuda") draws there."""
    if init not in ("hf", "stream"):
        raise ValueError(f"init must be 'hf' or 'stream', got {init!r}")
    import torch

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: this torch sees no CUDA device (draw on the CPU: device='cpu')")
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
    if init == "stream":
        _stream_weights(out, cfg, cls_model, dtype=getattr(torch, dtype), seed=seed, std=init_std, device=device,
                        max_shard_bytes=max_shard_bytes)
        meta = {"generator": "vime.tiny_model", "arch": arch, "seed": seed, "init": "stream", "device": device}
        (out / "vime_tiny.json").write_text(json.dumps(meta))
        return out
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


def _stream_weights(out: Path, cfg, cls_model, *, dtype, seed: int, std: float, device: str, max_shard_bytes: int):
    """init="stream": the parameters' names and shapes from the model built on the meta device (no memory), each
    drawn by its own generator (seeded by seed and its name, so the draw does not depend on order or threads),
    several at once, written shard by shard; then config.json and generation_config.json as `save_pretrained`
    writes them."""
    import hashlib
    import os
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    with torch.device("meta"):
        model = cls_model(cfg)
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # a tied head is the embedding: once
    dev = torch.device(device)

    def draw(item):
        name, shape = item
        g = torch.Generator(device=dev)
        g.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1)
        x = torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
        x = 1.0 + 0.1 * x if name.endswith("norm.weight") else x.mul_(std)
        return name, x.to(dtype).cpu().contiguous()

    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = {name: elem * torch.Size(shape).numel() for name, shape in params}
    shards, cur, size = [], [], 0
    for name, shape in params:
        if cur and size + nbytes[name] > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes[name]
    if cur:
        shards.append(cur)
    total = sum(nbytes.values())
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    workers = 4 if dev.type == "cuda" else max(1, min(16, os.cpu_count() or 1))
    t0, done = time.perf_counter(), 0
    with ThreadPoolExecutor(workers) as pool:
        for i, (fname, shard) in enumerate(zip(names, shards)):
            tensors = dict(pool.map(draw, shard))
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in tensors})
            done += sum(nbytes[n] for n in tensors)
            del tensors
            print(f"make_tiny_checkpoint: {fname} ({i + 1}/{len(names)}), {done / 2**30:.1f} of {total / 2**30:.1f} GiB "
                  f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    cfg.architectures = [cls_model.__name__]
    cfg.save_pretrained(out)
    GenerationConfig.from_model_config(cfg).save_pretrained(out)

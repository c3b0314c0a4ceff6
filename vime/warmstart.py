"""Build the `grpo_tiny` starting policy: a tiny model warm-started on the task's format.

What this module decides: where the default recipe's policy comes from. A
randomly initialised character-level model cannot find '3+4=' -> '7' by
sampling, so RL would have no reward signal; a short supervised warm start
(a few hundred steps on half the digit pairs, loss on the answer tokens only)
gives it the format and partial skill, and GRPO then raises the reward. The
warm start uses HF transformers (it is preparation, not the strict path) and
writes an ordinary HF checkpoint.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from .data.synthetic import addition_rows


def _examples(n: int, seed: int) -> list[tuple[str, str]]:
    return [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in addition_rows(n, seed=seed)]


def build_tiny_policy(out: str | Path, tiny, seed: int = 0, progress: bool = True, device: str = "cpu") -> Path:
    """Create `out` (tiny checkpoint + supervised warm start, on `device`) unless it already exists."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tiny_model import make_tiny_checkpoint

    out = Path(out)
    if (out / "vime_warmstart.json").exists():
        _check_built(out, tiny, seed)
        return out
    make_tiny_checkpoint(out, arch=tiny.arch, vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size,
                         intermediate_size=tiny.intermediate_size, num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                         num_kv_heads=tiny.num_kv_heads, head_dim=tiny.head_dim, max_position_embeddings=tiny.max_position_embeddings,
                         seed=seed)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    data = _examples(tiny.warmstart_rows, seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.warmstart_lr)
    eos = tok.eos_token
    losses = []
    for _ in tqdm(range(tiny.warmstart_steps), desc="warm start (supervised)", disable=not progress):
        batch = rng.sample(data, 64)
        ids, labels = [], []
        for prompt, answer in batch:
            p, a = tok(prompt)["input_ids"], tok(answer + eos)["input_ids"]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(map(len, ids))
        x = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in ids], device=device)
        y = torch.tensor([s + [-100] * (width - len(s)) for s in labels], device=device)
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.save_pretrained(out, safe_serialization=True)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()  # the roles (other processes) take the GPU next
    (out / "vime_warmstart.json").write_text(json.dumps({"steps": tiny.warmstart_steps, "lr": tiny.warmstart_lr, "seed": seed,
                                                         "loss_first": losses[0], "loss_last": losses[-1],
                                                         "model_tiny": _tiny_dict(tiny)}))
    return out


def _tiny_dict(tiny) -> dict:
    import dataclasses

    return dataclasses.asdict(tiny)


def _check_built(out: Path, tiny, seed: int) -> None:
    """An existing warm-started model is used only as what the config asks for: every model.tiny key it was built with
    equal to this run's (else refused, naming the keys); another run.seed is said (it seeded the build; this run's
    seeds its sampling). A marker of an earlier vime, without the keys, is said too."""
    import sys

    marker = json.loads((out / "vime_warmstart.json").read_text())
    built = marker.get("model_tiny")
    if built is None:
        print(f"vime: {out} was built by an earlier vime that did not record its model.tiny keys; using it as it is "
              f"(delete it to rebuild with this config)", file=sys.stderr)
        return
    differ = {k: (v, built.get(k)) for k, v in _tiny_dict(tiny).items() if built.get(k) != v}
    if differ:
        from .config import ConfigError

        raise ConfigError(f"model.path: {out} holds a tiny model built with other model.tiny keys: "
                          + ", ".join(f"model.tiny.{k}={old!r} there, {new!r} here" for k, (new, old) in sorted(differ.items()))
                          + f". Fix: delete {out} to rebuild it with this config, or set model.path to another directory")
    if marker.get("seed") != seed:
        print(f"vime: {out} was built with run.seed={marker.get('seed')}; this run's run.seed={seed} seeds its sampling only "
              "(delete the directory to rebuild the model with this seed)", file=sys.stderr)

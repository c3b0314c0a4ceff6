"""Fail early and clearly when a recipe needs what this machine lacks (GPUs, files)."""
from __future__ import annotations

import json
from pathlib import Path


class PreflightError(SystemExit):
    pass


def check_resources(cfg) -> None:
    problems = []
    need = cfg.resources.gpus
    if need:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < need:
            problems.append(f"recipe {cfg.run.name!r} needs {need} GPUs (trainer TP{cfg.trainer.tp}/CP{cfg.trainer.cp}/PP{cfg.trainer.pp}, "
                            f"{cfg.rollout.num_engines} vLLM engines at TP{cfg.rollout.tp}); this machine has {have}")
    hf = Path(cfg.model.path) / "config.json"
    if cfg.model.init == "existing" and not hf.exists():
        problems.append(f"model.path {cfg.model.path!r} is not an HF checkpoint directory (no config.json)")
    if hf.exists():  # a file read, not a model load: the engine's length must fit the model's
        limit = json.loads(hf.read_text()).get("max_position_embeddings")
        if limit is not None and cfg.rollout.max_model_len > limit:
            problems.append(f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's max_position_embeddings={limit} "
                            f"({hf}); set rollout.max_model_len<={limit}")
    if cfg.logging.wandb and cfg.logging.wandb_mode == "online" and not _wandb_key():  # else found after every role started
        problems.append("logging.wandb_mode=online but no wandb API key here (WANDB_API_KEY, or `wandb login`'s ~/.netrc "
                        "entry for api.wandb.ai); log in, or set logging.wandb_mode=offline (sync later with `wandb sync`)")
    if cfg.trainer.tp > 1:  # the model's canonical segments must split evenly over the TP ranks (checked before any load)
        problems += _tp_layout_problems(cfg, hf)
    if cfg.rollout.tp > 1 and cfg.rlkernel.rollout_engine() != "stock":  # the strict vLLM model shards like the trainer
        problems += _tp_layout_problems(cfg, hf, "rollout.tp", cfg.rollout.tp)
    if need:
        problems += _gpu_attention_problems(cfg, hf)
    if not cfg.data.generate and not Path(cfg.data.path).exists():
        problems.append(f"data.path {cfg.data.path!r} does not exist")
    if problems:
        raise PreflightError("vime: cannot run this recipe here:\n  - " + "\n  - ".join(problems))


def _gpu_attention_problems(cfg, hf: Path) -> list[str]:
    """Why a side running rlkernel's Triton attention on a GPU cannot take this model's heads
    (contracts.gpu.attention_head_dim_ok), before any engine starts; [] when it can, or when the model is not known yet."""
    from rlkernel.contracts.gpu import attention_head_dim_ok

    from .doctor import decoder_config, side_policy

    if not hf.exists() and cfg.model.init != "tiny_sft":
        return []
    sides = [s for s in ("rollout", "trainer") if side_policy(cfg, s).choice("attention") == "strict"
             and not (s == "rollout" and cfg.rlkernel.rollout_engine() == "stock")]
    d = decoder_config(cfg).head_dim
    if not sides or attention_head_dim_ok(d):
        return []
    fix = "rlkernel.ops.attention=fa3 (FlashAttention 3's contract, bf16 on sm_90)" if cfg.model.dtype == "bfloat16" else \
        "model.dtype=bfloat16 with rlkernel.ops.attention=fa3 (FlashAttention 3's contract, sm_90)"
    return [f"the model's head_dim={d} is not a power of two >= 16, which rlkernel's Triton attention needs on a GPU "
            f"({' and '.join(sides)} would run it); set {fix}, or run on the CPU (resources.gpus=0)"]


def _tp_layout_problems(cfg, hf: Path, key: str = "trainer.tp", tp: int | None = None) -> list[str]:
    """Why the trainer (or the strict rollout model) cannot shard this model at `key` (heads, KV heads, the canonical
    segments), from config.json or the tiny model the recipe builds; [] when it can, or when the model is not known yet."""
    from rlkernel.integrations.megatron_spec import MegatronSpecConfig

    from .doctor import decoder_config

    if not hf.exists() and cfg.model.init != "tiny_sft":
        return []
    dec = decoder_config(cfg)
    tp = cfg.trainer.tp if tp is None else tp
    try:
        MegatronSpecConfig(decoder=dec, tp=tp)
    except ValueError as e:
        return [f"{key}={tp} cannot shard this model: {e}; choose a {key} that divides it"]
    return []


def _wandb_key() -> bool:
    """Whether wandb would find an API key: WANDB_API_KEY, or a ~/.netrc (or $NETRC) entry for its host."""
    import netrc
    import os

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0].split(":")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False

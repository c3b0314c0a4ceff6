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
    if not cfg.data.generate and not Path(cfg.data.path).exists():
        problems.append(f"data.path {cfg.data.path!r} does not exist")
    if problems:
        raise PreflightError("vime: cannot run this recipe here:\n  - " + "\n  - ".join(problems))

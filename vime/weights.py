"""Where a run keeps the weights of each version, and how a version is found again.

What this module decides: the run directory is enough to rebuild the policy that generated
any step. Records say which weight version produced each token; this module turns a version
into an HF checkpoint directory. With `run.save_weights=true` the controller keeps every
version it generates with under `weights/` (`vNNNNNN.safetensors`, HF names, plus the
model's config and tokenizer files once): opt-in, because that is one copy of the model per
step. Without it a version is still found when a checkpoint holds it (`checkpoints/step_N`
holds version N) or, for version 0, when the base model directory the run recorded exists.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

WEIGHTS = "weights"


def _name(version: int) -> str:
    return f"v{version:06d}.safetensors"


def keep_version(run_dir: Path, model_path: Path, version: int, tensors: dict) -> Path:
    """Write version `version`'s HF-named tensors to run_dir/weights/ (atomically); the first call
    also copies the model's non-weight files (config.json, tokenizer) beside them."""
    from safetensors.torch import save_file

    root = Path(run_dir) / WEIGHTS
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "config.json").exists():
        for f in Path(model_path).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, root / f.name)
    tmp, final = root / f".tmp_{_name(version)}", root / _name(version)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, final)
    return final


def kept_versions(run_dir: Path) -> dict[int, Path]:
    """{version: safetensors file} of every version the run directory holds weights of."""
    run_dir = Path(run_dir)
    found = {}
    for meta in sorted(run_dir.glob("checkpoints/step_*/meta.json")):
        found[int(json.loads(meta.read_text())["weight_version"])] = meta.parent / "model.safetensors"
    for f in sorted((run_dir / WEIGHTS).glob("v*.safetensors")):
        found[int(f.name[1:7])] = f
    return found


def _config_files(run_dir: Path) -> Path | None:
    """A directory holding the model's config.json and tokenizer: weights/, else the base model the run recorded."""
    if (run_dir / WEIGHTS / "config.json").exists():
        return run_dir / WEIGHTS
    base = base_model(run_dir)
    return base if base is not None and (base / "config.json").exists() else None


def base_model(run_dir: Path) -> Path | None:
    """The model directory the run started from (provenance.json's config), if it exists here."""
    prov = Path(run_dir) / "provenance.json"
    if not prov.exists():
        return None
    path = Path(json.loads(prov.read_text())["config"]["model"]["path"])
    return path if path.exists() else None


def version_checkpoint(run_dir: Path, version: int, into: Path) -> Path:
    """An HF checkpoint directory (config + tokenizer + model.safetensors) of weight version
    `version`, assembled under `into` from what the run directory holds; names what is missing."""
    run_dir, into = Path(run_dir), Path(into)
    kept = kept_versions(run_dir)
    weights = kept.get(version)
    base = base_model(run_dir)
    if weights is None and version == 0 and base is not None:
        files = sorted(base.glob("*.safetensors"))
        weights = files[0] if len(files) == 1 else None
    config = _config_files(run_dir)
    if weights is None or config is None:
        have = ", ".join(f"v{v}" for v in sorted(kept)) or "none"
        raise FileNotFoundError(
            f"{run_dir} holds no weights of version {version} (versions it holds: {have}"
            f"{'; no model config either' if config is None else ''}). Re-run with run.save_weights=true "
            "(every version kept under weights/) or run.save_every=1 (a checkpoint per step).")
    into.mkdir(parents=True, exist_ok=True)
    for f in config.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, into / f.name)
    os.symlink(weights.resolve(), into / "model.safetensors")
    return into

"""Checkpoints: what a resume needs, written atomically, verified before anything is trusted.

What this module decides: the on-disk format of `checkpoints/step_N` and the order of a
resume. A checkpoint holds the policy's HF weights (`model.safetensors`), the trainer's
state (`trainer_state.safetensors` + `trainer_state.json`: optimizer, every RNG stream of
the trainer process, weight version) and `meta.json`: the step to run next (= the data
position: a step's prompts are a function of (seed, step)), the weight version, the
model's identity (hash of its config.json, dtype), the run's config, and a sha256 of every
file (and of meta itself). The rollout sampler has no state to save: every request
carries its own seed, derived from (run.seed, step, sample index) — `sample_seed`.

Why this shape:
* Nothing is unpickled: tensors go to safetensors, everything else to JSON (`pack_state`
  refuses any other type), so loading a checkpoint cannot run code.
* Writes go to `.tmp_step_N`, every file and the directory are fsynced, then renamed; an
  existing `step_N` is moved aside first and deleted only after the new one and `latest`
  are in place, so a crash at any point leaves a complete checkpoint behind `latest`.
* `resume_point` verifies everything (checksums, model identity, the metrics file it will
  cut) and loads the trainer state before the caller changes any file of the run;
  `truncate_run` — dropping metric lines, records and provenance of steps the resumed run
  will recompute — is called only once that state has been loaded into the roles.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = 1
STATE_TENSORS, STATE_JSON, WEIGHTS, META = "trainer_state.safetensors", "trainer_state.json", "model.safetensors", "meta.json"
# config keys a resume may change without changing what is computed
RESUMABLE_KEYS = ("trainer.total_steps", "run.resume", "run.save_every", "run.output_dir", "run.name", "run.executor", "run.call_timeout_s",
                  "run.start_timeout_s", "run.max_restarts", "run.fail_on_strict_violation", "logging.")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names it and what is wrong."""


def sample_seed(seed: int, step: int, index: int) -> int:
    """The sampler seed of sample `index` of `step`: independent of batch, engine state and resume."""
    digest = hashlib.sha256(f"vime-sample:{seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63: any engine's int64 seed


# ---------------------------------------------------------------------------- identity
def model_identity(model_path: Path, dtype: str) -> dict:
    """What makes a checkpoint belong to a model: its architecture (config.json, hashed canonically) and dtype."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    canon = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return {"config_sha256": hashlib.sha256(canon.encode()).hexdigest(), "dtype": dtype, "path": str(model_path), "config": config}


def _identity_problem(saved: dict, now: dict) -> str | None:
    if saved["config_sha256"] == now["config_sha256"] and saved["dtype"] == now["dtype"]:
        return None
    a, b = saved.get("config", {}), now["config"]
    differ = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if saved["dtype"] != now["dtype"]:
        differ.append(f"model.dtype: {saved['dtype']!r} -> {now['dtype']!r}")
    return (f"it was written for model {saved['path']} (config sha256 {saved['config_sha256'][:12]}), this run's model is "
            f"{now['path']} (config sha256 {now['config_sha256'][:12]}); differing: {'; '.join(differ) or 'config.json bytes'}")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_changes(saved: dict, now: dict) -> list[str]:
    """Config keys (other than RESUMABLE_KEYS) whose value differs: the resumed run is then not an exact continuation."""
    a, b = _flat(saved), _flat(now)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not any(k == r or k.startswith(r) for r in RESUMABLE_KEYS)]
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys]


# ---------------------------------------------------------------------------- state <-> safetensors + JSON
def pack_state(obj, tensors: dict, path: str = "state"):
    """A JSON-able mirror of `obj` with its tensors moved into `tensors` (dicts keep int keys, tuples stay tuples)."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().clone().contiguous()
        return {"$tensor": path}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"checkpoint state: {path} has a key that is neither str nor int")
        return {"$dict": [[k, pack_state(v, tensors, f"{path}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"$tuple": [pack_state(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [pack_state(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint state: {path} is a {type(obj).__name__}; only tensors, dicts, lists, tuples and JSON scalars are stored")


def unpack_state(obj, tensors: dict):
    if isinstance(obj, list):
        return [unpack_state(v, tensors) for v in obj]
    if isinstance(obj, dict):
        (tag, value), = obj.items()
        if tag == "$tensor":
            return tensors[value]
        if tag == "$tuple":
            return tuple(unpack_state(v, tensors) for v in value)
        if tag == "$dict":
            return {k: unpack_state(v, tensors) for k, v in value}
        raise ValueError(f"unknown tag {tag!r}")
    return obj


# ---------------------------------------------------------------------------- files
def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _meta_digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save(run_dir: Path, step: int, version: int, weights: dict, trainer_state: dict, identity: dict, config: dict) -> Path:
    """Write checkpoints/step_<step> atomically and point `latest` at it; returns its directory."""
    from safetensors.torch import save_file

    root = Path(run_dir) / "checkpoints"
    name = f"step_{step:06d}"
    final, tmp, old = root / name, root / f".tmp_{name}", root / f".old_{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS))
    tensors: dict = {}
    _write_text(tmp / STATE_JSON, json.dumps(pack_state(trainer_state, tensors)))
    save_file(tensors, str(tmp / STATE_TENSORS))
    files = {f: _sha256(tmp / f) for f in (WEIGHTS, STATE_TENSORS, STATE_JSON)}
    meta = {"format": FORMAT, "step": step, "data_position": step, "weight_version": version, "model": identity, "config": config,
            "files": files}
    meta["meta_sha256"] = _meta_digest(meta)
    _write_text(tmp / META, json.dumps(meta, indent=1))
    for f in files:
        _fsync(tmp / f)
    _fsync(tmp)
    if final.exists():  # re-saving a step (after a crash between the checkpoint and `latest`): keep it until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(root)
    _write_text(root / "latest.tmp", name)
    os.replace(root / "latest.tmp", root / "latest")
    _fsync(root)
    shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------- resume
@dataclass(kw_only=True, slots=True)
class ResumePoint:
    step: int  # the next step to run (= data position)
    weight_version: int  # version of the checkpoint's weights
    path: Path  # checkpoints/step_N
    weights: Path  # its model.safetensors (verified)
    trainer_state: dict  # optimizer, RNG streams, weight version (tensors + JSON scalars, no pickle)
    config_changes: list  # keys whose value differs from the checkpoint's run (not an exact continuation)


def _read_meta(ckpt: Path) -> dict:
    where = f"checkpoint {ckpt}"
    try:
        meta = json.loads((ckpt / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{where}: {META} is missing (an interrupted write?); resume from an earlier checkpoint by "
                              f"writing its name into {ckpt.parent / 'latest'}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: {META} is corrupt ({e})") from None
    if not isinstance(meta, dict) or meta.get("meta_sha256") != _meta_digest(meta):
        raise CheckpointError(f"{where}: {META} is corrupt (its checksum does not match its content)")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{where}: format {meta.get('format')!r}, this vime reads format {FORMAT}")
    return meta


def _verify_files(ckpt: Path, meta: dict) -> None:
    for name, want in meta["files"].items():
        path = ckpt / name
        if not path.exists():
            raise CheckpointError(f"checkpoint {ckpt}: {name} is missing")
        got = _sha256(path)
        if got != want:
            raise CheckpointError(f"checkpoint {ckpt}: {name} is corrupt (sha256 {got[:12]}, written as {want[:12]}); "
                                  f"nothing was changed in {ckpt.parent.parent}")


def _check_metrics(run_dir: Path, step: int) -> None:
    """The metric lines a resume keeps must be intact; only a torn last line (a crash mid-write) may be dropped."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            json.loads(line)
        except ValueError:
            if i != len(lines) - 1:
                raise CheckpointError(f"{path}: line {i + 1} is not JSON; the metrics file is corrupt before step {step}") from None


def resume_point(run_dir: Path, identity: dict, config: dict) -> ResumePoint:
    """Find, verify and load the latest checkpoint; nothing in run_dir is modified."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        raise FileNotFoundError(f"run.resume=true but {latest} does not exist")
    ckpt = run_dir / "checkpoints" / latest.read_text().strip()
    if not ckpt.is_dir():
        raise CheckpointError(f"{latest} names {ckpt.name}, which does not exist")
    meta = _read_meta(ckpt)
    problem = _identity_problem(meta["model"], identity)
    if problem:
        raise CheckpointError(f"checkpoint {ckpt} is refused: {problem}. Resume with the model it was trained from "
                              "(model.path, model.dtype), or start a new run.output_dir")
    _verify_files(ckpt, meta)
    _check_metrics(run_dir, meta["step"])
    try:
        state = unpack_state(json.loads((ckpt / STATE_JSON).read_text()), load_file(str(ckpt / STATE_TENSORS)))
    except (SafetensorError, ValueError, KeyError) as e:  # checksums matched: written wrong, not damaged since
        raise CheckpointError(f"checkpoint {ckpt}: the trainer state does not load ({type(e).__name__}: {e})") from e
    return ResumePoint(step=int(meta["step"]), weight_version=int(meta["weight_version"]), path=ckpt, weights=ckpt / WEIGHTS,
                       trainer_state=state, config_changes=config_changes(meta["config"], config))


def copy_model_files(model_path: str | Path, into: Path) -> None:
    """An HF checkpoint directory's files other than its weights (config, tokenizer) into `into`: with a weights file
    beside them, an HF checkpoint of other weights (the shard index stays behind: it would name the base's shards)."""
    for f in Path(model_path).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, Path(into) / f.name)


def hf_dir(ckpt: Path, model_path: Path) -> Path:
    """The checkpoint laid out as an HF checkpoint for vLLM: the base model's config/tokenizer files + its weights (hard link)."""
    hf, tmp = ckpt / "hf", ckpt / ".hf.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    copy_model_files(model_path, tmp)
    try:
        os.link(ckpt / WEIGHTS, tmp / WEIGHTS)
    except OSError:  # a filesystem without hard links
        shutil.copy(ckpt / WEIGHTS, tmp / WEIGHTS)
    shutil.rmtree(hf, ignore_errors=True)
    os.replace(tmp, hf)
    return hf


def truncate_run(run_dir: Path, step: int) -> str:
    """Drop what steps >= `step` wrote (they are recomputed): metric lines (atomically), records, per-step provenance.
    Returns what was dropped, for the console ("" when nothing was)."""
    path = run_dir / "metrics.jsonl"
    lines = 0
    if path.exists():
        keep = []
        old = path.read_text().splitlines()
        for line in old:
            try:
                if json.loads(line)["step"] < step:
                    keep.append(line)
            except ValueError:  # the torn last line _check_metrics allowed
                pass
        lines = len(old) - len(keep)
        tmp = path.with_suffix(".jsonl.tmp")
        _write_text(tmp, "".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    files = 0
    for sub, suffix in (("records", ".parquet"), ("provenance", ".json")):
        for f in (run_dir / sub).glob(f"step_*{suffix}"):
            if int(f.stem.split("_")[1]) >= step:
                f.unlink()
                files += 1
    return f"discarded {lines} metric line(s) and {files} record / provenance file(s) of steps >= {step}" if lines or files else ""

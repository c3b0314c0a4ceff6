"""The two roles of the loop: RolloutRole (vLLM + rewards) and TrainerRole (Megatron).

What this module decides: what each role owns and what crosses the boundary
(typed records, TrainBatch, HF-named weight dicts — no dict bags). Both are
plain classes: the Ray executor wraps them as actors, the in-process executor
calls them directly. Each role sets its own determinism/runtime settings and
reports them in `provenance()`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .batch import Scored, TrainBatch
from .checkpoint import sample_seed
from .config import VimeConfig
from .data.prompts import Prompt, encode_prompt
from .data.reward_worker import RewardWorker
from .executor import wait_started
from .records import SamplingSpec, Status, TokenRecord


def _strict_model_vocab(worker) -> int:
    """Runs inside the vLLM worker (collective_rpc): the vocab range the running model's logprobs normalise over."""
    return int(worker.model_runner.get_model().config.vocab_size)


def gpu_placement(cfg: VimeConfig, visible: str | None = None) -> dict[str, list[str]]:
    """On GPUs (resources.gpus > 0): the CUDA_VISIBLE_DEVICES of each trainer rank (one GPU each) and of each vLLM engine
    (rollout.tp GPUs each). Colocated (resources.colocate): the engines start again at the first GPU, sharing the trainer's
    devices (vLLM takes rollout.gpu_memory_utilization of each); else they take the GPUs after the trainer's. `visible`:
    the driver's own CUDA_VISIBLE_DEVICES (default: the environment's), whose entries are the devices handed out.
    {} on the CPU."""
    import os

    res = cfg.resources
    if not res.gpus:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(res.gpus)]
    world, tp, engines = cfg.trainer.tp * cfg.trainer.cp * cfg.trainer.pp, cfg.rollout.tp, cfg.rollout.num_engines
    first = 0 if res.colocate else world
    need = max(world, engines * tp) if res.colocate else world + engines * tp
    if need > len(ids):
        raise ValueError(f"the layout needs {need} GPUs but {len(ids)} are visible ({visible or 'resources.gpus'}); "
                         f"set CUDA_VISIBLE_DEVICES or shrink the layout")
    return {"trainer": [ids[r] for r in range(world)],
            "engines": [",".join(ids[first + e * tp + i] for i in range(tp)) for e in range(engines)]}


def gpu_memory_utilization(cfg: VimeConfig) -> float | None:
    """vLLM's share of each engine GPU's memory (None on the CPU)."""
    if not cfg.resources.gpus:
        return None
    return cfg.rollout.gpu_memory_utilization or (0.45 if cfg.resources.colocate else 0.85)


def default_enforce_eager(cfg: VimeConfig) -> bool:
    """rollout.enforce_eager when the recipe leaves it null: CUDA graphs on a GPU (stock: vLLM's compile + graphs;
    strict: decode-only graphs at rollout TP=1, the layout they are proved at), eager on the CPU."""
    from .rollout import graphs_proved

    return not cfg.resources.gpus or not graphs_proved(cfg.rlkernel.rollout_engine(), cfg.rollout.tp)


def ipc_weight_sync(cfg: VimeConfig) -> bool:
    """Whether the trainer hands its weights to the engines as IPC handles (rollout.weight_sync): "handles" always (the
    config checked that it can), "auto" on GPUs where every engine worker's GPU holds a trainer rank — colocated, Ray
    (separate processes), rollout.tp * num_engines <= trainer.tp * trainer.cp. No copy through host memory or a file."""
    r, t = cfg.rollout, cfg.trainer
    if r.weight_sync != "auto":
        return r.weight_sync == "handles"
    return bool(cfg.resources.gpus and cfg.resources.colocate and cfg.run.executor == "ray" and r.num_engines * r.tp <= t.tp * t.cp)


def handles_for_engines(payloads: list[dict], num_engines: int, tp: int) -> list[list[dict]]:
    """Trainer ranks' weight handles (one payload a rank, rank order) as each engine's list, one per worker: engine e's
    worker i opens those of trainer rank e * tp + i — the rank on its GPU under gpu_placement's colocated layout (both
    start at the first GPU); the worker checks the device (rlkernel.integrations.vllm_worker.pick_handles)."""
    if num_engines * tp > len(payloads):
        raise ValueError(f"{num_engines} engine(s) of {tp} worker(s) need as many trainer ranks' handles, got {len(payloads)}")
    return [payloads[e * tp:(e + 1) * tp] for e in range(num_engines)]


class RolloutRole:
    def __init__(self, cfg: VimeConfig, model_path: str, engine_id: str = "vllm-0"):
        from rlkernel.runtime import tune_cpu_allocator

        from .rollout import RolloutConfig, VLLMRollout

        self.cfg, self.engine_id = cfg, engine_id
        self._alloc = tune_cpu_allocator()
        r = cfg.rollout
        self.engine = VLLMRollout(RolloutConfig(
            model=model_path, engine=cfg.rlkernel.rollout_engine(), mode=cfg.rlkernel.mode, ops=cfg.rlkernel.side_ops("rollout"),
            dtype=cfg.model.dtype, temperature=r.temperature, max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=r.max_num_batched_tokens, block_size=r.block_size,
            enable_prefix_caching=r.enable_prefix_caching, kv_cache_gb=r.kv_cache_gb, seed=cfg.run.seed, engine_id=engine_id,
            max_model_len=r.max_model_len, tp=r.tp, gpu_memory_utilization=gpu_memory_utilization(cfg),
            row_segments=cfg.rlkernel.row_segments,
            enforce_eager=r.enforce_eager if r.enforce_eager is not None else default_enforce_eager(cfg),
            kernel_manifest=_kernel_manifest(cfg, engine_id) if cfg.rlkernel.rollout_engine() == "rlkernel" else None,
            kernel_manifest_seed=_kernel_manifest_seed(cfg) if cfg.rlkernel.rollout_engine() == "rlkernel" else None,
            compile_workers=cfg.trainer.compile_workers,
        ))
        self.tokenizer = self.engine.tokenizer
        self.rewards = RewardWorker(cfg.reward.fn, cfg.reward.timeout_s, memory_mb=cfg.reward.memory_mb)

    def provenance(self) -> dict:
        p = self.engine.provenance
        return {"env": p.env, "engine_args": p.engine_args, "allocator": self._alloc, "engine": self.engine.config.engine,
                "rlkernel": self.engine.llm.collective_rpc("rlkernel_info")[0] if self.engine.config.engine == "rlkernel" else None}

    def vocab_size(self) -> int:
        """The vocab range of the model running inside the engine (asked of the worker, not read from config.json)."""
        if self.engine.config.engine != "rlkernel":
            return self.engine.llm.llm_engine.model_config.get_vocab_size()
        sizes = set(self.engine.llm.collective_rpc(_strict_model_vocab))
        if len(sizes) != 1:
            raise RuntimeError(f"vLLM workers disagree on the vocab size: {sorted(sizes)}")
        return sizes.pop()

    def generate(self, step: int, prompts: list[Prompt], weight_version: int, first_group: int = 0) -> list[TokenRecord]:
        """samples_per_prompt completions of each prompt, rewarded, as versioned records. `first_group`: the
        step-wide index of prompts[0] (an engine of several serves a slice; ids and seeds stay step-wide)."""
        n, r = self.cfg.data.samples_per_prompt, self.cfg.rollout
        # one seed per sample, from (run.seed, step, step-wide index): the draws do not depend on the batch, the
        # engine's history, how prompts are split across engines or a resume, so the sampler has no state a
        # checkpoint would need
        specs = [SamplingSpec(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                              seed=sample_seed(self.cfg.run.seed, step, first_group * n + k)) for k in range(len(prompts) * n)]
        ids = [encode_prompt(self.tokenizer, p, self.cfg.data.template) for p in prompts]
        comps = self.engine.generate([i for i in ids for _ in range(n)], specs, weight_version=weight_version)
        rewards = self.rewards.score([(c.text, prompts[k // n].ground_truth) for k, c in enumerate(comps)])
        records = []
        for k, (c, rw) in enumerate(zip(comps, rewards)):
            g, s = divmod(k, n)
            p, g = prompts[g], first_group + g
            status = {"length": Status.TRUNCATED, "abort": Status.ABORTED}.get(c.finish_reason, Status.OK)
            trained = int(status is Status.OK or not self.cfg.algorithm.mask_truncated)  # algorithm.mask_truncated
            records.append(TokenRecord(
                record_id=f"{step}-{g}-{s}", step=step, prompt_id=p.prompt_id, group_id=g, sample_idx=s,
                prompt_ids=c.prompt_ids, response_ids=c.response_ids, loss_mask=[trained] * len(c.response_ids),
                rollout_logprobs=c.logprobs, weight_versions=[c.weight_version] * len(c.response_ids), engine_id=self.engine_id,
                sampling=specs[k], finish_reason=c.finish_reason, reward=rw.value, reward_status=rw.status, status=status,
                response_text=c.text,
            ))
        return records

    def update_weights(self, tensors: dict, version: int) -> int:
        self.engine.update_weights(tensors, version)
        return self.engine.weight_version

    def update_weights_ipc(self, handles: dict, version: int) -> int:
        """The trainer's CUDA tensors from their IPC handles, copied in place: opened by the strict engine's worker, or
        here for stock vLLM and handed to its own reload_weights."""
        self.engine.update_weights_ipc(handles, version)
        return self.engine.weight_version

    def take_provenance(self) -> dict:
        """rlkernel op calls inside the engine since the last take (model forward + logprobs). A stock engine
        runs vLLM's own kernels under no rlkernel contract: each op is listed as such (calls not counted)."""
        if self.engine.config.engine == "stock":
            from rlkernel.integrations.vllm_compat import vllm_version

            import rlkernel as rk

            device = "cuda" if torch.cuda.is_available() else "cpu"
            return {op: [{"backend": "native", "impl": "vllm", "contract_id": f"vllm-{vllm_version()}-stock", "device": device,
                          "calls": None}] for op in rk.OPS}
        return self.engine.llm.collective_rpc("rlkernel_take_provenance")[0]

    def set_weight_version(self, version: int) -> None:
        """After a resume: the engine was built from checkpoint weights of this version."""
        self.engine.weight_version = int(version)


def _kernel_manifest(cfg: VimeConfig, engine_id: str | None = None) -> str | None:
    """trainer.kernel_manifest as a path, GPU runs only: "auto" is the run directory's triton_kernels.json; a rollout
    engine's is that name with its id (triton_kernels_vllm-0.json), one file a process (none writes another's)."""
    m = cfg.trainer.kernel_manifest
    if not m or not cfg.resources.gpus:
        return None
    p = Path(cfg.run.output_dir) / "triton_kernels.json" if m == "auto" else Path(m).expanduser()
    return str(p if engine_id is None else p.with_name(f"{p.stem}_{engine_id}{p.suffix}"))


def _kernel_manifest_seed(cfg: VimeConfig) -> str | None:
    """trainer.kernel_manifest_seed as an absolute path (a relative one is the recipes directory's), on GPU runs that
    keep a manifest and run the mode the seed was recorded in (a strict arm's kernels are not a native run's); None
    otherwise. A seed that is not there, or not a seed, stops the run here, before any role starts."""
    seed = cfg.trainer.kernel_manifest_seed
    if not seed or not cfg.trainer.kernel_manifest or not cfg.resources.gpus:
        return None
    from .config import RECIPES

    p = Path(seed).expanduser()
    p = p if p.is_absolute() else RECIPES / p
    if not p.is_file():
        raise FileNotFoundError(f"trainer.kernel_manifest_seed={seed}: no file at {p} (make one with "
                                "scripts/make_kernel_seed.py, or set trainer.kernel_manifest_seed=null)")
    from rlkernel.backends.triton.precompile import load_seed

    try:
        arm = load_seed(p)["recorded"].get("arm")
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"trainer.kernel_manifest_seed={seed}: {p} is not a kernel manifest seed ({e}); make one with "
                         "scripts/make_kernel_seed.py, or set trainer.kernel_manifest_seed=null") from e
    return None if arm not in (None, cfg.rlkernel.mode) else str(p)


class TrainerRole:
    def __init__(self, cfg: VimeConfig, model_path: str, weights: str | None = None, rank: int = 0, world_size: int = 1,
                 init_method: str | None = None):
        """Built from the HF checkpoint `model_path`; `weights` (a resumed checkpoint's model.safetensors)
        then replaces the policy's weights, so a reference model stays the base model. One rank of a
        trainer group when world_size > 1 (TrainerGroup drives them)."""
        from rlkernel.runtime import tune_cpu_allocator

        from .grpo import GRPOConfig
        from .trainer import MegatronTrainer, TrainerConfig

        self.cfg = cfg
        self._alloc = tune_cpu_allocator()
        a, t = cfg.algorithm, cfg.trainer
        grpo = GRPOConfig(clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                          entropy_coef=a.entropy_coef, tis_cap=a.tis_cap, normalize_adv_std=a.normalize_adv_std)
        self.trainer = MegatronTrainer(TrainerConfig(
            mode=cfg.rlkernel.mode, ops=cfg.rlkernel.side_ops("trainer"), tp=t.tp, cp=t.cp, token_segments=t.token_segments, micro_batch_tokens=t.micro_batch_tokens, dtype=cfg.model.dtype,
            seed=cfg.run.seed, threads=t.threads, lr=t.lr, grad_clip=t.grad_clip, grpo=grpo,
            rank=rank, world_size=world_size, init_method=init_method, device="cuda" if cfg.resources.gpus else "cpu",
            row_segments=cfg.rlkernel.row_segments, kernel_manifest=_kernel_manifest(cfg), compile_workers=t.compile_workers,
            kernel_manifest_seed=_kernel_manifest_seed(cfg),
        ))
        self._ipc_keep = None  # the tensors behind the last IPC handles: alive until the engine has copied them
        self.rank = rank
        self.trainer.load_hf(model_path)
        if weights is not None:
            from safetensors.torch import load_file

            self.trainer.load_weights(load_file(weights), version=0)  # the version comes with load_state

    def provenance(self) -> dict:
        return {**self.trainer.provenance, "allocator": self._alloc}

    def vocab_size(self) -> int:
        """The vocab range of the trainer's logprob head."""
        return self.trainer.model.output_layer.vocab_size

    def score(self, batch: TrainBatch) -> Scored:
        """Old-policy logprobs, the version they were computed with and the digest of what was scored."""
        return self.trainer.score_with_digest(batch)

    def update(self, batch: TrainBatch) -> dict:
        at = self.cfg.trainer.profile_update
        if at is None or self.trainer.weight_version != at:
            return self.trainer.update(batch)
        from .profiling import profiled  # trainer.profile_update: this step's update under torch.profiler

        metrics, summary = profiled(lambda: self.trainer.update(batch), self.trainer.config.device)
        if self.rank == 0:
            out = Path(self.cfg.run.output_dir) / "profile" / f"update_step_{at:06d}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"step": at, "mode": self.trainer.config.mode, "tokens": metrics.get("tokens"), **summary}, indent=1))
        return metrics

    def export_weights(self, version: int) -> dict | None:
        """The full HF-named weights; in a group every rank takes part in the gather, rank 0 returns them."""
        hf = self.trainer.export_weights(version, keep=self.rank == 0)  # the others only take part in the gathers
        return hf if self.rank == 0 else None

    def export_weights_ipc(self, version: int) -> dict:
        """This rank's full HF-named weights as torch IPC handles (torch's own reduction: (rebuild function, args)) for the
        engine worker on the same device: on a GPU, CUDA IPC of tensors gathered over TP on the GPU; on the CPU, shared
        memory ("file_system" sharing: a name any process on this host opens). {"device", "rank", "handles"}; the
        tensors stay referenced here until `release_ipc`."""
        from torch.multiprocessing.reductions import reduce_tensor

        from rlkernel.integrations.vllm_worker import device_ident

        on_gpu = self.trainer.config.device == "cuda"
        self._ipc_keep = self.trainer.export_weights(version, device="cuda" if on_gpu else "cpu")
        if on_gpu:
            torch.cuda.synchronize()
        else:
            torch.multiprocessing.set_sharing_strategy("file_system")  # fds cannot cross to vLLM's worker processes; names can
            self._ipc_keep = {k: v.share_memory_() for k, v in self._ipc_keep.items()}
        return {"device": device_ident("cuda" if on_gpu else "cpu"), "rank": self.rank,  # (export: contiguous copies)
                "handles": {k: reduce_tensor(v) for k, v in self._ipc_keep.items()}}

    def release_ipc(self) -> None:
        self._ipc_keep = None

    def take_provenance(self) -> dict:
        return self.trainer.take_provenance()

    def state(self) -> dict:
        """Trainer state a checkpoint needs besides the weights: optimizer, every RNG stream of this
        process (torch CPU and CUDA, Python, NumPy), version. Tensors and JSON scalars only (vime.checkpoint)."""
        import random

        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos,
                                                                                        has_gauss, gauss)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        # on the CPU before it leaves: the driver would otherwise rebuild GPU tensors on its own (shared) GPU
        opt = _to_cpu(self.trainer.optimizer.state_dict())
        return {"optimizer": opt, "weight_version": self.trainer.weight_version, "rng": rng}

    def load_state(self, state: dict) -> None:
        """Restore optimizer, RNG streams and version after building from the checkpoint's weights."""
        import random

        import numpy as np

        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.weight_version = int(state["weight_version"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        name, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


# ---------------------------------------------------------------------------- groups of role processes
def merge_op_provenance(summaries: list[dict]) -> dict:
    """Several processes' rlkernel call counts ({op: [{backend, impl, contract_id, device, calls}]}) as one."""
    total: dict[tuple, int] = {}
    for summary in summaries:
        for op, entries in summary.items():
            for e in entries:
                key = (op, e["backend"], e["impl"], e["contract_id"], e["device"])
                prev, n = total.get(key, 0), e["calls"]
                total[key] = None if prev is None or n is None else prev + n  # None: not counted (a stock engine)
    out: dict[str, list[dict]] = {}
    for (op, backend, impl, cid, device), n in sorted(total.items()):
        out.setdefault(op, []).append({"backend": backend, "impl": impl, "contract_id": cid, "device": device, "calls": n})
    return out


class TrainerGroup:
    """The trainer as trainer.tp * trainer.cp Ray actors, one per rank, forming one torch.distributed world
    (gloo on CPU, NCCL on GPUs) at a file store of the executor; driven through one handle with the
    TrainerRole calls. Every call goes to every rank at once (their collectives meet). Results: rank 0's,
    after checking that every rank scored (and updated) the same bits — a TP group whose ranks disagree
    is an error, not a number."""

    def __init__(self, executor, cfg: VimeConfig, model_path: str, weights: str | None = None):
        self.world = cfg.trainer.tp * cfg.trainer.cp
        store = executor.group_store() if self.world > 1 else None
        gpus = gpu_placement(cfg).get("trainer")
        self.ranks = [executor.spawn(TrainerRole, cfg, model_path, weights, rank, self.world, store, name=f"trainer[rank {rank}]",
                                     env={"CUDA_VISIBLE_DEVICES": gpus[rank]} if gpus else None)
                      for rank in range(self.world)]

    def _all(self, method: str, *args) -> list:
        wait_started(self.ranks)  # a rank that dies while starting is named at once, not after the others' start limit
        pending = [h.async_call(method, *args) for h in self.ranks]
        if len(self.ranks) > 1 and all(getattr(h, "actor", None) is not None for h in self.ranks):
            self._first_failure(pending, method)
        return [h.wait(p, method) for h, p in zip(self.ranks, pending)]

    def _first_failure(self, pending: list, method: str) -> None:
        """Ranks finish in any order: take each result as it comes, so a rank that died is named at once — the others
        would wait in their collectives until the call's limit. Raises what that rank's wait raises (RoleDiedError for
        a dead process), or RoleTimeoutError naming the ranks still busy when the limit passes."""
        import time

        import ray

        from .executor import RoleTimeoutError

        left = dict(zip(pending, self.ranks))
        limit = self.ranks[0].timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        while left:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(left), num_returns=1, timeout=wait)
            if not ready:
                busy = ", ".join(h.name for h in left.values())
                raise RoleTimeoutError(f"{busy}: {method} did not return within {limit:g} s (run.call_timeout_s); a rank is hung or "
                                       "the limit is too short for this model — raise run.call_timeout_s")
            for ref in ready:
                left.pop(ref).wait(ref, method)

    def call(self, method: str, *args):
        if method == "load_state":
            return self._load_state(*args)
        out = self._all(method, *args)
        if method == "take_provenance":
            return merge_op_provenance(out)
        if method == "state":  # every rank holds the optimizer state of its own shards
            return out[0] if self.world == 1 else {"world_size": self.world, "ranks": out}
        if method == "score":
            for rank, s in enumerate(out[1:], 1):
                if s.digest != out[0].digest or not all(map(torch.equal, s.logprobs, out[0].logprobs)):
                    raise RuntimeError(f"trainer ranks 0 and {rank} scored different bits (or different tokens): a TP group must agree")
        if method == "update" and any(u["loss"] != out[0]["loss"] for u in out[1:]):
            raise RuntimeError(f"trainer ranks disagree on the GRPO loss: {[u['loss'] for u in out]}")
        if method == "provenance":
            return out[0] | {"world_size": self.world, "ranks": len(out)}
        if method == "export_weights_ipc":  # every rank's handles: each engine worker opens those on its own device
            return out
        return out[0]

    def _load_state(self, state: dict) -> None:
        ranks = state["ranks"] if "ranks" in state else [state]
        if len(ranks) != self.world:
            raise ValueError(f"the checkpoint's trainer state is from {len(ranks)} trainer rank(s); this run has "
                             f"trainer.tp*trainer.cp={self.world} — resume with the layout it was written with")
        pending = [h.async_call("load_state", s) for h, s in zip(self.ranks, ranks)]
        for h, p in zip(self.ranks, pending):
            h.wait(p, "load_state")


class RolloutEngines:
    """rollout.num_engines vLLM engines (each a RolloutRole actor) behind one handle: a step's prompts are split
    into contiguous slices, one per engine, generated at once and joined in prompt order; record ids and
    sampling seeds stay step-wide, so the records are those one engine would produce (batch invariance and
    per-sample seeds). Weights go to every engine from one copy in the object store."""

    MAX_RESTARTS_PER_CALL = 2

    def __init__(self, executor, cfg: VimeConfig, model_path: str, weights_for=None, version: int = 0):
        """`weights_for(version)`: the HF weights of a version (the trainer's export), for an engine restarted
        after it died; `version`: the weight version the engines start at (a resumed checkpoint's)."""
        self.executor, self.weights_for, self.version = executor, weights_for, version
        self.restarts = 0  # engines restarted since the last take_restarts
        self.tp = cfg.rollout.tp
        gpus = gpu_placement(cfg).get("engines")
        self.engines = [executor.spawn(RolloutRole, cfg, model_path, f"vllm-{e}", name=f"rollout[vllm-{e}]",
                                       env={"CUDA_VISIBLE_DEVICES": gpus[e]} if gpus else None)
                        for e in range(cfg.rollout.num_engines)]

    def take_restarts(self) -> int:
        n, self.restarts = self.restarts, 0
        return n

    def _restart(self, e: int, err: Exception, bring_up: bool = True) -> None:
        """A dead engine (its actor and the vLLM engine inside it killed or crashed) comes back at self.version
        (bring_up=False: the call being retried is the weight update that moves it past that version)."""
        import sys

        h = self.engines[e]
        print(f"vime: {h.name} failed ({err}); restarting it at weight version {self.version}", file=sys.stderr)
        h.restart()
        h.call("take_provenance")  # its start-up calls are not the step's
        if bring_up and self.version > 0:
            if self.weights_for is None:
                raise RuntimeError(f"{h.name} restarted but no weights of version {self.version} can be fetched") from err
            h.call("update_weights", self.weights_for(self.version), self.version)
        self.restarts += 1

    def _all(self, method: str, per_engine_args: list[tuple]) -> list:
        from .executor import RoleDiedError, RoleTimeoutError

        pending = [h.async_call(method, *a) for h, a in zip(self.engines, per_engine_args)]
        out = []
        for e, (h, p, a) in enumerate(zip(self.engines, pending, per_engine_args)):
            for attempt in range(self.MAX_RESTARTS_PER_CALL + 1):
                try:
                    out.append(h.wait(p, method))
                    break
                except (RoleDiedError, RoleTimeoutError) as err:  # a hung engine is killed and restarted like a dead one
                    if attempt == self.MAX_RESTARTS_PER_CALL:
                        raise
                    self._restart(e, err, bring_up=not method.startswith("update_weights"))  # then the same call again: seeds are per sample, so a regenerated slice is the same
                    p = h.async_call(method, *a)
        return out

    def call(self, method: str, *args):
        n = len(self.engines)
        if method == "generate":
            step, prompts, version = args
            bounds = [len(prompts) * e // n for e in range(n + 1)]
            parts = self._all("generate", [(step, prompts[a:b], version, a) for a, b in zip(bounds, bounds[1:])])
            return [r for part in parts for r in part]
        if method == "update_weights" and n > 1:
            tensors, version = args
            args = (self.executor.share(tensors), version)
        if method == "update_weights_ipc":  # trainer ranks' handles (rank order): each engine those of its workers' GPUs
            payloads, version = args
            out = self._all(method, [(mine, version) for mine in handles_for_engines(payloads, n, self.tp)])
        else:
            out = self._all(method, [args] * n)
        if method in ("update_weights", "update_weights_ipc", "set_weight_version"):
            self.version = int(args[0] if method == "set_weight_version" else args[1])
        if method == "take_provenance":
            return merge_op_provenance(out)
        if method == "vocab_size" and len(set(out)) != 1:
            raise RuntimeError(f"the rollout engines disagree on the vocab size: {out}")
        if method == "provenance":
            return out[0] | {"num_engines": n}
        return out[0]

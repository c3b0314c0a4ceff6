"""The two roles of the loop: RolloutRole (vLLM + rewards) and TrainerRole (Megatron).

What this module decides: what each role owns and what crosses the boundary
(typed records, TrainBatch, HF-named weight dicts — no dict bags). Both are
plain classes: the Ray executor wraps them as actors, the in-process executor
calls them directly. Each role sets its own determinism/runtime settings and
reports them in `provenance()`.
"""
from __future__ import annotations

import torch

from .batch import Scored, TrainBatch
from .checkpoint import sample_seed
from .config import VimeConfig
from .data.prompts import Prompt, encode_prompt
from .data.reward_worker import RewardWorker
from .records import SamplingSpec, Status, TokenRecord


def _strict_model_vocab(worker) -> int:
    """Runs inside the vLLM worker (collective_rpc): the vocab range the running model's logprobs normalise over."""
    return int(worker.model_runner.model.config.vocab_size)


class RolloutRole:
    def __init__(self, cfg: VimeConfig, model_path: str, engine_id: str = "vllm-0"):
        from rlkernel.runtime import tune_cpu_allocator

        from .rollout import RolloutConfig, VLLMRollout

        self.cfg, self.engine_id = cfg, engine_id
        self._alloc = tune_cpu_allocator()
        r = cfg.rollout
        self.engine = VLLMRollout(RolloutConfig(
            model=model_path, engine="rlkernel", mode=cfg.rlkernel.mode, ops=cfg.rlkernel.side_ops("rollout"),
            dtype=cfg.model.dtype, temperature=r.temperature, max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=r.max_num_batched_tokens, block_size=r.block_size,
            enable_prefix_caching=r.enable_prefix_caching, kv_cache_gb=r.kv_cache_gb, seed=cfg.run.seed, engine_id=engine_id,
            max_model_len=r.max_model_len,
        ))
        self.tokenizer = self.engine.tokenizer
        self.rewards = RewardWorker(cfg.reward.fn, cfg.reward.timeout_s, memory_mb=cfg.reward.memory_mb)

    def provenance(self) -> dict:
        p = self.engine.provenance
        return {"env": p.env, "engine_args": p.engine_args, "allocator": self._alloc,
                "rlkernel": self.engine.llm.collective_rpc("rlkernel_info")[0] if self.engine.config.engine == "rlkernel" else None}

    def vocab_size(self) -> int:
        """The vocab range of the model running inside the engine (asked of the worker, not read from config.json)."""
        if self.engine.config.engine != "rlkernel":
            return self.engine.llm.llm_engine.model_config.get_vocab_size()
        sizes = set(self.engine.llm.collective_rpc(_strict_model_vocab))
        if len(sizes) != 1:
            raise RuntimeError(f"vLLM workers disagree on the vocab size: {sorted(sizes)}")
        return sizes.pop()

    def generate(self, step: int, prompts: list[Prompt], weight_version: int) -> list[TokenRecord]:
        """samples_per_prompt completions of each prompt, rewarded, as versioned records."""
        n, r = self.cfg.data.samples_per_prompt, self.cfg.rollout
        # one seed per sample, from (run.seed, step, index): the draws do not depend on the batch, the
        # engine's history or a resume, so the sampler has no state a checkpoint would need
        specs = [SamplingSpec(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, seed=sample_seed(self.cfg.run.seed, step, k))
                 for k in range(len(prompts) * n)]
        ids = [encode_prompt(self.tokenizer, p, self.cfg.data.template) for p in prompts]
        comps = self.engine.generate([i for i in ids for _ in range(n)], specs, weight_version=weight_version)
        rewards = self.rewards.score([(c.text, prompts[k // n].ground_truth) for k, c in enumerate(comps)])
        records = []
        for k, (c, rw) in enumerate(zip(comps, rewards)):
            g, s = divmod(k, n)
            p = prompts[g]
            status = Status.TRUNCATED if c.finish_reason == "length" else Status.OK
            records.append(TokenRecord(
                record_id=f"{step}-{g}-{s}", step=step, prompt_id=p.prompt_id, group_id=g, sample_idx=s,
                prompt_ids=c.prompt_ids, response_ids=c.response_ids, loss_mask=[1] * len(c.response_ids),
                rollout_logprobs=c.logprobs, weight_versions=[c.weight_version] * len(c.response_ids), engine_id=self.engine_id,
                sampling=specs[k], finish_reason=c.finish_reason, reward=rw.value, reward_status=rw.status, status=status,
                response_text=c.text,
            ))
        return records

    def update_weights(self, tensors: dict, version: int) -> int:
        self.engine.update_weights(tensors, version)
        return self.engine.weight_version

    def take_provenance(self) -> dict:
        """rlkernel op calls inside the engine since the last take (model forward + logprobs)."""
        return self.engine.llm.collective_rpc("rlkernel_take_provenance")[0]

    def set_weight_version(self, version: int) -> None:
        """After a resume: the engine was built from checkpoint weights of this version."""
        self.engine.weight_version = int(version)


class TrainerRole:
    def __init__(self, cfg: VimeConfig, model_path: str, weights: str | None = None):
        """Built from the HF checkpoint `model_path`; `weights` (a resumed checkpoint's model.safetensors)
        then replaces the policy's weights, so a reference model stays the base model."""
        from rlkernel.runtime import tune_cpu_allocator

        from .grpo import GRPOConfig
        from .trainer import MegatronTrainer, TrainerConfig

        self.cfg = cfg
        self._alloc = tune_cpu_allocator()
        a, t = cfg.algorithm, cfg.trainer
        grpo = GRPOConfig(clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                          entropy_coef=a.entropy_coef, tis_cap=a.tis_cap, normalize_adv_std=a.normalize_adv_std)
        self.trainer = MegatronTrainer(TrainerConfig(
            mode=cfg.rlkernel.mode, ops=cfg.rlkernel.side_ops("trainer"), tp=t.tp, dtype=cfg.model.dtype,
            seed=cfg.run.seed, threads=t.threads, lr=t.lr, grad_clip=t.grad_clip, grpo=grpo,
        ))
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
        return self.trainer.update(batch)

    def export_weights(self, version: int) -> dict:
        return self.trainer.export_weights(version)

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
        return {"optimizer": self.trainer.optimizer.state_dict(), "weight_version": self.trainer.weight_version, "rng": rng}

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

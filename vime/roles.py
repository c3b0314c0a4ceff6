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
            model=model_path, engine="rlkernel", mode=cfg.rlkernel.mode, ops=tuple(sorted(cfg.rlkernel.ops.as_dict().items())),
            dtype=cfg.model.dtype, temperature=r.temperature, max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=r.max_num_batched_tokens, block_size=r.block_size,
            enable_prefix_caching=r.enable_prefix_caching, kv_cache_gb=r.kv_cache_gb, seed=cfg.run.seed, engine_id=engine_id,
            max_model_len=r.max_model_len,
        ))
        self.tokenizer = self.engine.tokenizer
        self.rewards = RewardWorker(cfg.reward.fn, cfg.reward.timeout_s)

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
        spec = SamplingSpec(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, seed=None)
        ids = [encode_prompt(self.tokenizer, p, self.cfg.data.template) for p in prompts]
        comps = self.engine.generate([i for i in ids for _ in range(n)], spec, weight_version=weight_version)
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
                sampling=spec, finish_reason=c.finish_reason, reward=rw.value, reward_status=rw.status, status=status,
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
    def __init__(self, cfg: VimeConfig, model_path: str):
        from rlkernel.runtime import tune_cpu_allocator

        from .grpo import GRPOConfig
        from .trainer import MegatronTrainer, TrainerConfig

        self.cfg = cfg
        self._alloc = tune_cpu_allocator()
        a, t = cfg.algorithm, cfg.trainer
        grpo = GRPOConfig(clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                          entropy_coef=a.entropy_coef, tis_cap=a.tis_cap, normalize_adv_std=a.normalize_adv_std)
        self.trainer = MegatronTrainer(TrainerConfig(
            mode=cfg.rlkernel.mode, ops=tuple(sorted(cfg.rlkernel.ops.as_dict().items())), tp=t.tp, dtype=cfg.model.dtype,
            seed=cfg.run.seed, threads=t.threads, lr=t.lr, grad_clip=t.grad_clip, grpo=grpo,
        ))
        self.trainer.load_hf(model_path)

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
        """Trainer state a checkpoint needs besides the weights: optimizer, RNG, version."""
        return {"optimizer": self.trainer.optimizer.state_dict(), "weight_version": self.trainer.weight_version,
                "torch_rng": torch.get_rng_state()}

    def load_state(self, state: dict) -> None:
        """Restore optimizer, RNG and version after building from the checkpoint's weights."""
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.weight_version = int(state["weight_version"])
        torch.set_rng_state(state["torch_rng"])

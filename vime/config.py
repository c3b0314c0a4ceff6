"""Run configuration: Hydra structured schemas, one section per component.

What this module decides: the keys a recipe may set and how they are checked.
Each section is a dataclass validated in `__post_init__`; the whole tree is
registered in Hydra's ConfigStore as `vime_schema`, recipes in `recipes/` are
short YAMLs on top of it, and `load_config(name, overrides)` composes, checks
and returns a read-only `VimeConfig`. Keys checks and users rely on:
`run.output_dir`, `trainer.total_steps`, `rlkernel.mode=strict|native`,
`rlkernel.ops.<op>=strict|native`, `algorithm.use_rollout_logprobs`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass(kw_only=True, slots=True)
class RunSection:
    name: str = "run"
    output_dir: str = "runs/default"  # metrics.jsonl, records/, checkpoints/, wandb/ live here
    seed: int = 1234
    resume: bool = False  # continue from output_dir/checkpoints/latest
    save_every: int = 0  # checkpoint every N steps (0: only at the end)
    executor: str = "ray"  # "ray" (roles are actors) or "inprocess" (debugging)

    def __post_init__(self):
        _choice("run.executor", self.executor, ("ray", "inprocess"))
        if self.save_every < 0:
            raise ValueError("run.save_every must be >= 0")


@dataclass(kw_only=True, slots=True)
class TinyModelSection:  # used when model.init == "tiny_sft"
    arch: str = "qwen3"
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # stock vLLM's CPU attention (the native arm) has no kernel for 16
    warmstart_steps: int = 80  # supervised steps on the task format before RL (~30% sampled accuracy)
    warmstart_lr: float = 3e-3
    warmstart_rows: int = 2000


@dataclass(kw_only=True, slots=True)
class ModelSection:
    path: str = "models/tiny-qwen3"  # local HF checkpoint directory
    init: str = "existing"  # "existing": must exist; "tiny_sft": build a tiny model + warm start if missing
    dtype: str = "float32"
    tiny: TinyModelSection = field(default_factory=TinyModelSection)

    def __post_init__(self):
        _choice("model.init", self.init, ("existing", "tiny_sft", "smollm2"))
        _choice("model.dtype", self.dtype, ("float32", "bfloat16"))


@dataclass(kw_only=True, slots=True)
class DataSection:
    path: str = "data/addition.parquet"
    layout: str = "dapo"  # "dapo" (dapo-math-17k) or "gsm8k"
    generate: str = ""  # synthetic task to write to `path` when missing: "addition" | "word_problems"
    num_rows: int = 2000  # rows to generate
    template: str = "raw"  # "raw": user text as is; "chat": the tokenizer's chat template
    prompts_per_step: int = 8
    samples_per_prompt: int = 8  # GRPO group size

    def __post_init__(self):
        _choice("data.layout", self.layout, ("dapo", "gsm8k"))
        _choice("data.generate", self.generate, ("", "addition", "word_problems"))
        _choice("data.template", self.template, ("raw", "chat"))
        if self.prompts_per_step < 1 or self.samples_per_prompt < 2:
            raise ValueError("need prompts_per_step >= 1 and samples_per_prompt >= 2 (GRPO compares within a group)")


@dataclass(kw_only=True, slots=True)
class RolloutSection:
    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_gb: int = 1
    num_engines: int = 1
    tp: int = 1

    def __post_init__(self):
        if self.max_tokens < 1 or not self.temperature > 0 or self.num_engines < 1 or self.tp < 1:
            raise ValueError("rollout: max_tokens >= 1, temperature > 0, num_engines >= 1, tp >= 1")


@dataclass(kw_only=True, slots=True)
class TrainerSection:
    total_steps: int = 20
    lr: float = 1e-3
    grad_clip: Optional[float] = 1.0
    tp: int = 1
    cp: int = 1
    pp: int = 1
    threads: Optional[int] = None

    def __post_init__(self):
        if self.total_steps < 1 or self.tp < 1 or self.cp < 1 or self.pp < 1:
            raise ValueError("trainer: total_steps, tp, cp, pp must be >= 1")


@dataclass(kw_only=True, slots=True)
class AlgorithmSection:
    use_rollout_logprobs: bool = False  # old-policy logprobs: rollout's (true) or the trainer's recompute (false)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    entropy_coef: float = 0.0
    tis_cap: Optional[float] = None  # truncated importance sampling (for native runs)
    normalize_adv_std: bool = True


@dataclass(kw_only=True, slots=True)
class OpOverrides:
    """Per-op P/R ablations: "" follows rlkernel.mode; "strict" or "native" overrides it."""

    rms_norm: str = ""
    linear: str = ""
    swiglu: str = ""
    rope: str = ""
    attention: str = ""
    linear_logprob: str = ""

    def __post_init__(self):
        from rlkernel import OPS

        assert set(OPS) == {f for f in self.__slots__}, "OpOverrides must list exactly rlkernel.OPS"
        for op in OPS:
            _choice(f"rlkernel.ops.{op}", getattr(self, op), ("", "strict", "native"))

    def as_dict(self) -> dict[str, str]:
        return {op: getattr(self, op) for op in self.__slots__ if getattr(self, op)}


@dataclass(kw_only=True, slots=True)
class RlkernelSection:
    mode: str = "strict"  # both engines: "strict" or "native"
    ops: OpOverrides = field(default_factory=OpOverrides)

    def __post_init__(self):
        _choice("rlkernel.mode", self.mode, ("strict", "native"))


@dataclass(kw_only=True, slots=True)
class LoggingSection:
    wandb: bool = True
    wandb_mode: str = "offline"  # "offline" unless a key is configured and "online" chosen
    project: str = "vime"
    progress: bool = True

    def __post_init__(self):
        _choice("logging.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))


@dataclass(kw_only=True, slots=True)
class ResourcesSection:
    gpus: int = 0  # GPUs the recipe needs (0: CPU)
    nodes: int = 1
    colocate: bool = True  # rollout and trainer share the devices


@dataclass(kw_only=True, slots=True)
class VimeConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    rlkernel: RlkernelSection = field(default_factory=RlkernelSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    resources: ResourcesSection = field(default_factory=ResourcesSection)

    def __post_init__(self):
        if self.trainer.pp > 1:
            raise ValueError("trainer.pp > 1 is not supported yet (tied embeddings across stages)")


def _register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="vime_schema", node=VimeConfig)


def load_config(name: str, overrides: list[str] | None = None, recipes: Path = RECIPES) -> tuple[VimeConfig, dict]:
    """Compose recipe `name` with Hydra overrides; returns (validated config, plain dict for logs)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    _register()
    if not (recipes / f"{name}.yaml").exists():
        known = sorted(p.stem for p in recipes.glob("*.yaml"))
        raise FileNotFoundError(f"no recipe {name!r} in {recipes} (known: {known})")
    with initialize_config_dir(config_dir=str(recipes), version_base=None):
        cfg = compose(config_name=name, overrides=list(overrides or []))
    OmegaConf.set_readonly(cfg, True)
    return OmegaConf.to_object(cfg), OmegaConf.to_container(cfg, resolve=True)

"""Run configuration: Hydra structured schemas, one section per component.

What this module decides: the keys a recipe may set and how they are checked.
Each section is a dataclass validated in `__post_init__`; the whole tree is
registered in Hydra's ConfigStore as `vime_schema`, recipes in `recipes/` are
short YAMLs on top of it, and `load_config(name, overrides)` composes, checks
and returns a read-only `VimeConfig`. Keys checks and users rely on:
`run.output_dir`, `trainer.total_steps`, `rlkernel.mode=strict|native`,
`rlkernel.ops.<op>=strict|native`, `algorithm.use_rollout_logprobs`.

Why everything is checked here: a bad value should fail in a second, before any
model loads, with a `ConfigError` that names the key and the fix — not minutes
later inside a Ray actor. Unknown (misspelled) keys, wrong types, out-of-range
values, resources this loop cannot use and unsupported combinations all stop here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")  # what vime.data.prompts reads
GENERATE_LAYOUT = {"addition": "dapo", "word_problems": "gsm8k"}  # synthetic task -> the layout it is written in


class ConfigError(ValueError):
    """A recipe or override that cannot run; the message names the key and the fix."""


def _require(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}. Fix: {fix}")


def _choice(name, value, allowed):
    _require(value in allowed, name, f"must be one of {allowed}, got {value!r}", f"set {name}=<one of {', '.join(map(str, allowed))}>")


def _positive(key: str, value, *, zero_ok: bool = False, example=None) -> None:
    ok = value is not None and math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    bound = ">= 0" if zero_ok else "> 0"
    _require(ok, key, f"must be a finite number {bound}, got {value!r}", f"set {key}={example if example is not None else 1}")


@dataclass(kw_only=True, slots=True)
class RunSection:
    name: str = "run"
    output_dir: str = "runs/default"  # metrics.jsonl, records/, checkpoints/, wandb/ live here
    seed: int = 1234
    resume: bool = False  # continue from output_dir/checkpoints/latest
    save_every: int = 0  # checkpoint every N steps (0: only at the end)
    save_weights: bool = False  # keep every weight version under weights/ (what `vime replay` re-scores with); opt-in: a copy per step
    executor: str = "ray"  # "ray" (roles are actors) or "inprocess" (debugging)
    call_timeout_s: float = 1800.0  # the longest the driver waits for one remote call (a step's rollout, score, update, sync)
    start_timeout_s: float = 1800.0  # the longest the driver waits for a role to start (its process and model load; counted apart from calls)
    max_restarts: int = 2  # a role that dies: every role restarts and the run resumes from its last checkpoint, this many times
    fail_on_strict_violation: bool = False  # `vime train` exits 3 when a strict run had a step that was not strict,
    # ran other contracts on the two engines, could not be compared or mismatched (its summary says which); else 0

    def __post_init__(self):
        _choice("run.executor", self.executor, ("ray", "inprocess"))
        _positive("run.call_timeout_s", self.call_timeout_s, example="1800 (seconds; raise it for big models or slow machines)")
        _positive("run.start_timeout_s", self.start_timeout_s, example="1800 (seconds; raise it for big models or slow machines)")
        _positive("run.max_restarts", self.max_restarts, zero_ok=True, example="2 (0: stop at the first role that dies)")
        _require(bool(self.output_dir), "run.output_dir", "is empty", "set run.output_dir=runs/<name>")
        _positive("run.save_every", self.save_every, zero_ok=True, example=10)
        _positive("run.seed", self.seed, zero_ok=True, example=1234)


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
    max_position_embeddings: int = 2048  # the model's length limit (rollout.max_model_len must fit)
    warmstart_steps: int = 80  # supervised steps on the task format before RL (~30% sampled accuracy)
    warmstart_lr: float = 3e-3
    warmstart_rows: int = 2000

    def __post_init__(self):
        _choice("model.tiny.arch", self.arch, ("qwen3", "llama"))
        _require(self.vocab_size >= 100, "model.tiny.vocab_size", f"the character tokenizer needs >= 100 ids, got {self.vocab_size}",
                 "set model.tiny.vocab_size=128")
        for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                  "warmstart_steps", "warmstart_lr"):
            _positive(f"model.tiny.{k}", getattr(self, k))
        _require(self.num_heads % self.num_kv_heads == 0, "model.tiny.num_kv_heads",
                 f"must divide model.tiny.num_heads={self.num_heads}, got {self.num_kv_heads}", "choose a divisor of num_heads")
        _require(self.warmstart_rows >= 64, "model.tiny.warmstart_rows", f"the warm start samples batches of 64 rows, got {self.warmstart_rows}",
                 "set model.tiny.warmstart_rows=2000")


@dataclass(kw_only=True, slots=True)
class ModelSection:
    path: str = "models/tiny-qwen3"  # local HF checkpoint directory
    init: str = "existing"  # "existing": must exist; "tiny_sft": build a tiny model + warm start if missing
    dtype: str = "float32"
    tiny: TinyModelSection = field(default_factory=TinyModelSection)

    def __post_init__(self):
        _choice("model.init", self.init, ("existing", "tiny_sft", "smollm2"))
        _choice("model.dtype", self.dtype, ("float32", "bfloat16"))
        _require(bool(self.path), "model.path", "is empty", "set model.path=<HF checkpoint directory>")


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
        _choice("data.generate", self.generate, ("", *GENERATE_LAYOUT))
        _choice("data.template", self.template, ("raw", "chat"))
        suffix = Path(self.path).suffix
        _require(suffix in DATA_SUFFIXES, "data.path", f"{self.path!r} is a {suffix or 'suffix-less'} file; vime reads {'/'.join(DATA_SUFFIXES)}",
                 "convert it (e.g. pandas.read_csv(...).to_parquet('x.parquet')) in the dapo or gsm8k layout and point data.path at it")
        if self.generate:
            _require(suffix in (".parquet", ".jsonl"), "data.path", f"data.generate writes .parquet or .jsonl, not {suffix!r}",
                     "give data.path a .parquet or .jsonl name")
            want = GENERATE_LAYOUT[self.generate]
            _require(self.layout == want, "data.layout", f"data.generate={self.generate} writes the {want} layout, got data.layout={self.layout}",
                     f"set data.layout={want}")
        _positive("data.num_rows", self.num_rows, example=2000)
        _positive("data.prompts_per_step", self.prompts_per_step, example=8)
        _require(self.samples_per_prompt >= 2, "data.samples_per_prompt", f"GRPO compares within a group of >= 2, got {self.samples_per_prompt}",
                 "set data.samples_per_prompt=8")


@dataclass(kw_only=True, slots=True)
class RolloutSection:
    max_tokens: int = 8  # response tokens per sample
    max_model_len: int = 1024  # prompt + response tokens the engine holds per sequence (longer prompts are quarantined)
    temperature: float = 1.0
    top_p: float = 1.0
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_gb: int = 1
    num_engines: int = 1
    tp: int = 1
    # GPUs (resources.gpus > 0): the fraction of each engine GPU's memory vLLM takes (weights + KV cache); 0: 0.45 when the
    # trainer shares the GPU (resources.colocate), else 0.85. Ignored on the CPU (kv_cache_gb sizes the cache there).
    gpu_memory_utilization: float = 0.0
    # vLLM without CUDA graphs / torch.compile. null: eager on the CPU; on a GPU, stock vLLM (the native arm) runs vLLM's
    # production default (compiled, CUDA graphs) and the strict engine captures decode-only CUDA graphs without compiling
    # (at rollout.tp=1, where they are proved; eager at tp>1)
    enforce_eager: Optional[bool] = None
    # how the trainer's weights reach the engines after each update. "auto": "handles" where it applies (GPUs, colocated,
    # Ray, and every engine GPU holds a trainer rank), else "host". "handles": each trainer rank shares its full weights
    # as torch IPC handles (CUDA IPC on a GPU: a device-to-device copy; shared memory on the CPU) and every engine worker
    # opens those of the trainer rank on its own device. "host": the weights gathered to trainer rank 0's host memory and
    # sent on (TP>1 engines read them from one file).
    weight_sync: str = "auto"

    def __post_init__(self):
        _require(self.weight_sync in ("auto", "handles", "host"), "rollout.weight_sync",
                 f"must be auto, handles or host, got {self.weight_sync!r}", "set rollout.weight_sync=auto")
        _require(0 <= self.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization",
                 f"must be in [0, 1) (0: automatic), got {self.gpu_memory_utilization}", "set rollout.gpu_memory_utilization=0.45")
        for k in ("max_tokens", "max_model_len", "temperature", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_gb",
                  "num_engines", "tp"):
            _positive(f"rollout.{k}", getattr(self, k))
        _require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}", "set rollout.top_p=1.0 (no nucleus cut)")
        _require(self.max_tokens < self.max_model_len, "rollout.max_tokens",
                 f"{self.max_tokens} response tokens leave no room for a prompt in rollout.max_model_len={self.max_model_len}",
                 f"lower rollout.max_tokens below {self.max_model_len}, or raise rollout.max_model_len (up to the model's max_position_embeddings)")
        _require(self.max_num_batched_tokens >= self.max_num_seqs, "rollout.max_num_batched_tokens",
                 f"vLLM needs >= rollout.max_num_seqs={self.max_num_seqs}, got {self.max_num_batched_tokens}",
                 f"set rollout.max_num_batched_tokens={max(256, self.max_num_seqs)}")


@dataclass(kw_only=True, slots=True)
class TrainerSection:
    total_steps: int = 20
    lr: float = 1e-3
    grad_clip: Optional[float] = 1.0
    tp: int = 1
    cp: int = 1
    pp: int = 1
    threads: Optional[int] = None
    # canonical token segments of the strict update's backward (rlkernel.parallel.token_segments): 1 = off; S (a power of
    # two, a multiple of cp) = every sum over tokens per segment and one tree, so runs at CP=1, 2, ... S with the same S
    # are bitwise equal (slower: attention's backward by pieces, one GEMM per segment for each weight gradient)
    token_segments: int = 1
    # the update's forwards and backwards (and scoring's) take the batch in runs of whole samples of at most this many
    # tokens, the gradients accumulated over them (activation memory bounded by this, not by the batch: a full-size
    # batch at 8B does not fit one forward); 0: the whole batch at once. The strict path's logprobs are the same bits
    # either way (batch invariance); the gradients are summed micro-batch by micro-batch (another order than 0's)
    micro_batch_tokens: int = 0
    # profile the update of this step (0-based; the update that makes weight version N+1) with torch.profiler:
    # run_dir/profile/update_step_N.json (host and device time, kernel launches, the host's waits for the device). That
    # step's wall times include the profiler's overhead
    profile_update: Optional[int] = None
    # compile-ahead of rlkernel's Triton kernels (GPU runs; rlkernel/backends/triton/precompile.py): the trainer records
    # every kernel specialization it compiles into this JSON manifest and, when the file exists at start, compiles its
    # entries in parallel before the first step (a fresh machine's first strict step otherwise spends ~2 minutes
    # compiling one kernel at a time). "auto": run_dir/triton_kernels.json (a resumed run, or a new run pointed at an
    # old run's manifest, starts warm); the strict rollout engines keep theirs beside it (triton_kernels_vllm-0.json);
    # null: off
    kernel_manifest: Optional[str] = "auto"
    # a recorded run's manifests shipped with a recipe (precompile.make_seed: scripts/make_kernel_seed.py), merged into
    # this run's (the trainer's and each strict engine's) before the first step, so that a fresh machine compiles ahead
    # too. A relative path is the recipes directory's (recipes/kernel_manifests/...). GPU runs with kernel_manifest in
    # the mode the seed was recorded in (a strict arm's seed is not merged into a native run); entries the code no
    # longer takes, or recorded for another GPU architecture or Triton, are skipped and counted in the provenance.
    # null: none
    kernel_manifest_seed: Optional[str] = None
    compile_workers: Optional[int] = None  # compile-ahead's processes (null: the CPU count, at most 16)

    def __post_init__(self):
        _positive("trainer.total_steps", self.total_steps, example=20)
        if self.compile_workers is not None:
            _positive("trainer.compile_workers", self.compile_workers, example="8 (or null: the CPU count, at most 16)")
        _require(self.profile_update is None or (isinstance(self.profile_update, int) and self.profile_update >= 0),
                 "trainer.profile_update", f"must be a step index >= 0 or null, got {self.profile_update!r}", "set trainer.profile_update=10")
        _positive("trainer.lr", self.lr, example=1e-3)
        if self.grad_clip is not None:
            _positive("trainer.grad_clip", self.grad_clip, example="1.0 (or null: no clipping)")
        for k in ("tp", "cp", "pp"):
            _positive(f"trainer.{k}", getattr(self, k))
        if self.threads is not None:
            _positive("trainer.threads", self.threads, example="2 (or null: keep the process setting)")
        _require(isinstance(self.micro_batch_tokens, int) and self.micro_batch_tokens >= 0, "trainer.micro_batch_tokens",
                 f"must be an int >= 0 (0: the whole batch at once), got {self.micro_batch_tokens!r}",
                 "set trainer.micro_batch_tokens=16384 (or 0)")
        s = self.token_segments
        _require(isinstance(s, int) and s >= 1 and not s & (s - 1) and (s == 1 or s % self.cp == 0), "trainer.token_segments",
                 f"must be a power of two and a multiple of trainer.cp={self.cp} (1: off), got {s}",
                 f"set trainer.token_segments={max(2, self.cp)} (the same value in every run you compare across CP sizes)")


@dataclass(kw_only=True, slots=True)
class AlgorithmSection:
    use_rollout_logprobs: bool = False  # old-policy logprobs: rollout's (true) or the trainer's recompute (false)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    entropy_coef: float = 0.0
    tis_cap: Optional[float] = None  # TIS weight min(exp(recompute - rollout), cap); needs use_rollout_logprobs=false
    normalize_adv_std: bool = True
    # DAPO's overlong filtering: a sample that did not end by EOS / a stop string (truncated at rollout.max_tokens, or
    # aborted by the engine) keeps its reward in its group's advantage but is not trained on (loss mask all 0); its
    # logprobs are still compared (mismatch_count covers every token)
    mask_truncated: bool = False

    def __post_init__(self):
        from .grpo import KL_ESTIMATORS

        _choice("algorithm.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _require(0 <= self.clip_eps_low < 1, "algorithm.clip_eps_low", f"must be in [0, 1), got {self.clip_eps_low}",
                 "set algorithm.clip_eps_low=0.2")
        _positive("algorithm.clip_eps_high", self.clip_eps_high, zero_ok=True, example=0.28)
        _positive("algorithm.kl_coef", self.kl_coef, zero_ok=True, example="0.001 (or 0: no reference model)")
        _positive("algorithm.entropy_coef", self.entropy_coef, zero_ok=True, example=0.0)
        if self.tis_cap is not None:
            _positive("algorithm.tis_cap", self.tis_cap, example=2.0)
            # the ratio's denominator would be the rollout's logprobs, so the TIS weight exp(old - rollout) is exactly 1
            _require(not self.use_rollout_logprobs, "algorithm.tis_cap",
                     "with algorithm.use_rollout_logprobs=true the TIS weight exp(old - rollout) is exp(0) = 1: TIS would do nothing",
                     "for TIS keep algorithm.use_rollout_logprobs=false (ratio vs the trainer's recompute, weighted by "
                     "min(exp(recompute - rollout), tis_cap)); or drop algorithm.tis_cap")


@dataclass(kw_only=True, slots=True)
class OpOverrides:
    """Per-op P/R ablations: "" follows rlkernel.mode; "strict" or "native" overrides it. attention also takes "fa3":
    the strict path with FlashAttention 3 (vLLM's build, one KV split) instead of the Triton kernels, GPU only, bf16/fp16,
    checked at load (rlkernel/backends/fa3.py); set it in `ops`, so both engines run it (on one side only the two sides
    run different contracts: an ablation)."""

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
            _choice(f"rlkernel.ops.{op}", getattr(self, op), ("", "strict", "native", "fa3") if op == "attention" else ("", "strict", "native"))

    def as_dict(self) -> dict[str, str]:
        return {op: getattr(self, op) for op in self.__slots__ if getattr(self, op)}


@dataclass(kw_only=True, slots=True)
class RlkernelSection:
    mode: str = "strict"  # both engines: "strict" or "native"
    ops: OpOverrides = field(default_factory=OpOverrides)  # both engines
    rollout_ops: OpOverrides = field(default_factory=OpOverrides)  # the rollout engine only, over `ops` (one-sided ablations)
    trainer_ops: OpOverrides = field(default_factory=OpOverrides)  # the trainer only, over `ops`
    # the rollout engine of a run whose rollout side is native everywhere: "stock" (production vLLM, its own kernels:
    # no rlkernel code in vLLM — the drift users see in production) or "rlkernel" (the plugin with rlkernel's native ops)
    native_rollout: str = "stock"
    # both engines: the canonical K segments of the row-parallel layers (o, down) and of the column-parallel input
    # gradient, the largest power of two <= this that divides K (rlkernel.ops.linear.canonical_segments), merged by one
    # tree. Runs at every TP size dividing it are bitwise equal. "auto" (the default): the run's largest TP size
    # (auto_row_segments: the smallest power of two every trainer.tp and rollout.tp divides), so each rank of the
    # engine with the most ranks holds one segment and runs plain GEMMs, and a TP=1 run has none; an engine with fewer
    # ranks sums its rank's segments by the tree. A number pins it: runs of different layouts with the same value are
    # bitwise comparable (4: TP 1, 2 and 4); runs with different values are not (another sum order)
    row_segments: Any = "auto"

    def __post_init__(self):
        _choice("rlkernel.mode", self.mode, ("strict", "native"))
        _choice("rlkernel.native_rollout", self.native_rollout, ("stock", "rlkernel"))
        s = self.row_segments
        _require(s == "auto" or (isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= 64 and not s & (s - 1)),
                 "rlkernel.row_segments", f"must be auto or a power of two from 1 to 64, got {s!r}",
                 "set rlkernel.row_segments=auto (the default), or 4 to compare bits across TP sizes 1, 2 and 4")

    def rollout_engine(self) -> str:
        """"stock" when the rollout runs no strict op and native_rollout=stock; otherwise "rlkernel" (the plugin)."""
        ops = dict(self.side_ops("rollout"))
        native = self.mode == "native" and all(v == "native" for v in ops.values())
        return "stock" if native and self.native_rollout == "stock" else "rlkernel"

    def side_ops(self, side: str) -> tuple:
        """The per-op overrides one engine ("rollout" or "trainer") runs: `ops`, then its own."""
        own = self.rollout_ops if side == "rollout" else self.trainer_ops
        return tuple(sorted((self.ops.as_dict() | own.as_dict()).items()))


@dataclass(kw_only=True, slots=True)
class RewardSection:
    fn: str = "math_verify"  # a name in vime.data.rewards.REWARD_FNS, or "package.module:function" (escape hatch)
    timeout_s: float = 15.0  # per sample; a slower reward is killed and counted as "timeout"
    memory_mb: int = 4096  # address-space limit of the reward process (RLIMIT_AS); beyond it allocations fail (MemoryError)

    def __post_init__(self):
        import importlib.util

        from .data.reward_worker import REWARD_FNS

        _positive("reward.timeout_s", self.timeout_s, example=15.0)
        _require(self.memory_mb >= 256, "reward.memory_mb", f"the reward process needs >= 256 MB to import Python and math-verify, "
                 f"got {self.memory_mb}", "set reward.memory_mb=4096")
        if self.fn in REWARD_FNS:
            return
        module, _, attr = self.fn.partition(":")
        _require(bool(module and attr), "reward.fn", f"{self.fn!r} is neither a registered reward {sorted(REWARD_FNS)} nor 'module:function'",
                 f"set reward.fn={next(iter(REWARD_FNS))} or reward.fn=my_package.rewards:my_reward")
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        _require(spec is not None, "reward.fn", f"module {module!r} is not importable here", "install it, or put it on PYTHONPATH")
        names = _top_level_names(spec.origin)  # read, not imported: the reward's code runs only in its own process
        funcs = sorted(n for n in (names or {}) if names[n] and not n.startswith("_"))
        _require(names is None or attr in names, "reward.fn", f"module {module!r} ({spec.origin}) defines no {attr!r} at its top "
                 f"level", f"name a function it defines ({', '.join(funcs[:6]) or 'it defines none'})")


def _top_level_names(origin: str | None) -> dict[str, bool] | None:
    """The names a Python source file binds at its top level (functions, classes, assignments, imports) -> whether the
    name is a function defined there; None where that cannot be read without running it (not a .py file, one that does
    not parse, a star import)."""
    import ast

    if not origin or not origin.endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(origin).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    names: dict[str, bool] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = not isinstance(node, ast.ClassDef)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update({n.id: False for n in ast.walk(t) if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None  # a star import binds names this reading cannot see
            names.update({(a.asname or a.name).split(".")[0]: False for a in node.names})
    return names


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

    def __post_init__(self):
        _positive("resources.gpus", self.gpus, zero_ok=True, example="0 (CPU)")
        _positive("resources.nodes", self.nodes)


@dataclass(kw_only=True, slots=True)
class VimeConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    rlkernel: RlkernelSection = field(default_factory=RlkernelSection)
    reward: RewardSection = field(default_factory=RewardSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    resources: ResourcesSection = field(default_factory=ResourcesSection)

    def __post_init__(self):
        t, r, res = self.trainer, self.rollout, self.resources
        _require(t.pp == 1, "trainer.pp", f"pipeline parallelism is not supported yet (tied embeddings across stages), got {t.pp}",
                 "set trainer.pp=1")
        _require(not (t.token_segments > 1 and self.rlkernel.mode != "strict"), "trainer.token_segments",
                 f"the token-segmented backward is a strict contract; rlkernel.mode={self.rlkernel.mode}", "set trainer.token_segments=1")
        _require(not (t.token_segments > 1 and self.algorithm.entropy_coef), "trainer.token_segments",
                 "the entropy bonus's gradient is not token-segmented", "set algorithm.entropy_coef=0 or trainer.token_segments=1")
        _require(not (self.algorithm.entropy_coef and t.tp > 1), "algorithm.entropy_coef",
                 f"an entropy bonus needs the full-vocab entropy, implemented for trainer.tp=1 only (got trainer.tp={t.tp})",
                 "set algorithm.entropy_coef=0 or trainer.tp=1")
        if self.model.init == "tiny_sft":
            _require(r.max_model_len <= self.model.tiny.max_position_embeddings, "rollout.max_model_len",
                     f"{r.max_model_len} exceeds the tiny model's max_position_embeddings={self.model.tiny.max_position_embeddings}",
                     f"set rollout.max_model_len<={self.model.tiny.max_position_embeddings}")
        if self.rlkernel.row_segments == "auto":  # resolved here, once: every reader of the config sees the number
            self.rlkernel.row_segments = auto_row_segments(**{"trainer.tp": t.tp, "rollout.tp": r.tp})
        for key, v in (("trainer.tp", t.tp), ("rollout.tp", r.tp)):  # a TP size must divide the canonical segment count
            _require(self.rlkernel.row_segments % v == 0, key, f"{v} does not divide rlkernel.row_segments="
                     f"{self.rlkernel.row_segments}: each rank must hold whole canonical segments",
                     f"set rlkernel.row_segments={max(v, self.rlkernel.row_segments)} (a multiple of {v}) or {key}=1")
        for key, v in (("trainer.tp", t.tp), ("trainer.cp", t.cp), ("rollout.num_engines", r.num_engines)):
            _require(v == 1 or self.run.executor == "ray", key, f"{v} processes need the Ray executor, got run.executor={self.run.executor}",
                     "set run.executor=ray")
        _require(not (self.rlkernel.rollout_engine() == "stock" and res.gpus == 0 and r.block_size % 32), "rollout.block_size",
                 f"stock vLLM on CPU (the native arm's rollout) needs a multiple of 32, got {r.block_size}",
                 "set rollout.block_size=32 (or rlkernel.native_rollout=rlkernel)")
        if any(dict(self.rlkernel.side_ops(side)).get("attention") == "fa3" for side in ("rollout", "trainer")):
            _require(res.gpus > 0, "rlkernel.ops.attention", "fa3 (FlashAttention 3, vLLM's CUDA build) runs on GPUs only; this run has "
                     "resources.gpus=0", "set resources.gpus>=1, or rlkernel.ops.attention=strict")
            _require(self.model.dtype == "bfloat16", "rlkernel.ops.attention", f"fa3 has no {self.model.dtype} kernel (bf16 only here)",
                     "set model.dtype=bfloat16, or rlkernel.ops.attention=strict")
            _require(t.cp == 1 or dict(self.rlkernel.side_ops("trainer")).get("attention") != "fa3", "rlkernel.ops.attention",
                     f"fa3 is not proven under context parallelism (trainer.cp={t.cp}): CP's attention runs the paged form on a "
                     "page table of block size 1, which FA3's load-time probe does not cover (pages of 16 and 64) and FA3 "
                     "refuses to differentiate", "set rlkernel.ops.attention=strict for CP runs, or trainer.cp=1")
        if r.weight_sync == "handles":
            _require(self.run.executor == "ray", "rollout.weight_sync", "handles pass between processes: they need the Ray executor "
                     f"(run.executor={self.run.executor} runs the roles in this process, where the tensors pass by reference)",
                     "set run.executor=ray, or rollout.weight_sync=auto")
            _require(r.num_engines * r.tp <= t.tp * t.cp, "rollout.weight_sync", f"handles need a trainer rank on every engine "
                     f"device: rollout.tp*num_engines={r.tp * r.num_engines} workers, trainer tp*cp={t.tp * t.cp} ranks",
                     "set rollout.weight_sync=host, or give the trainer at least as many ranks as the engines have workers")
            _require(res.gpus == 0 or res.colocate, "rollout.weight_sync", "CUDA IPC handles open on the GPU that holds them: "
                     "the engines must share the trainer's GPUs (resources.colocate=false here)", "set resources.colocate=true, or rollout.weight_sync=host")
        _require(t.profile_update is None or t.profile_update < t.total_steps, "trainer.profile_update",
                 f"step {t.profile_update} is past the run's last (trainer.total_steps={t.total_steps}): nothing would be profiled",
                 f"set trainer.profile_update to a step below {t.total_steps}, or null")
        # every role runs on this node: the Ray executor listens on loopback only (vime.executor), so another node's
        # GPUs would be counted here and never used
        _require(res.nodes == 1, "resources.nodes", f"{res.nodes} nodes: vime runs every role on this node (its Ray listens "
                 "on loopback only)", "set resources.nodes=1 and resources.gpus to this node's GPUs")
        if res.gpus != 0:
            have, train, roll = res.gpus * res.nodes, t.tp * t.cp * t.pp, r.tp * r.num_engines
            need = max(train, roll) if res.colocate else train + roll
            _require(need <= have, "resources.gpus", f"the layout needs {need} GPUs (trainer tp*cp*pp={train}, rollout tp*num_engines={roll}, "
                     f"colocate={res.colocate}) but resources.gpus*nodes={have}", f"set resources.gpus>={need} or shrink the layout")


def _register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="vime_schema", node=VimeConfig)


def auto_row_segments(**tp_sizes: int) -> int:
    """rlkernel.row_segments=auto: the smallest power of two that every TP size of the run divides (its largest TP
    size when all are powers of two). Each rank of the engine with the most ranks then holds exactly one canonical
    segment: its row-parallel GEMM is a plain one and the tree runs across ranks; at TP=1 on both sides there is no
    tree at all. A TP size that is not a power of two has no such count (the tree's segments halve)."""
    for key, v in tp_sizes.items():  # key: where the size was set (trainer.tp, rollout.tp, --tp)
        _require(isinstance(v, int) and v >= 1 and not v & (v - 1), key,
                 f"rlkernel.row_segments=auto needs power-of-two TP sizes (the canonical segments halve), got {v!r}",
                 f"set {key} to 1, 2, 4 or 8")
    return max(tp_sizes.values())


def load_config(name: str, overrides: list[str] | None = None, recipes: Path = RECIPES) -> tuple[VimeConfig, dict]:
    """Compose recipe `name` with Hydra overrides; returns (validated config, plain dict for logs)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .config_errors import explain, unknown_keys

    _register()
    for o in overrides or []:  # Hydra's own node is dropped by compose: its keys would be accepted and ignored
        key = o.lstrip("+~").split("=", 1)[0]
        _require(not key.startswith("hydra.") and key != "hydra", key, "Hydra's own settings are not used by `vime train` "
                 "(its run directory, logging, sweeps)", "set run.output_dir=<dir> for where the run writes; drop the hydra override")
    if not (recipes / f"{name}.yaml").exists():
        known = sorted(p.stem for p in recipes.glob("*.yaml"))
        raise FileNotFoundError(f"no recipe {name!r} in {recipes} (known: {known})")
    try:
        with initialize_config_dir(config_dir=str(recipes), version_base=None):
            cfg = compose(config_name=name, overrides=list(overrides or []))
    except (HydraException, OmegaConfBaseException) as e:
        raise explain(e, VimeConfig) from e
    plain = OmegaConf.to_container(cfg, resolve=True)
    unknown_keys(plain, VimeConfig)
    OmegaConf.set_readonly(cfg, True)
    return OmegaConf.to_object(cfg), plain

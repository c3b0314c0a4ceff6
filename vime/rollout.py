"""Rollout engine: vLLM generation with float32 logprobs and versioned weights.

What this module decides: how vime drives vLLM. `engine="rlkernel"` loads the
rlkernel plugin (its model classes and attention backend; logprobs from the
linear-logprob contract; vLLM runs at request temperature 1.0 with the rollout
temperature inside the model and `logprobs_mode="raw_logits"` on the CPU, or
"raw_logprobs" with the model's sampler wrapper on vLLM's V2 CUDA runner —
`vllm_compat.contract_logprobs_mode`), and `mode`
(strict | native, plus per-op `ops`) picks the rlkernel backends inside it — the
P/R ablation arms. `engine="stock"` runs unmodified vLLM with
`processed_logprobs` (log-softmax of logits / T): the negative control of
`vime parity` and the rollout of the loop's native arm (no rlkernel code in vLLM). Its
weights are replaced in place through vLLM's own `reload_weights` (rlkernel's
`vllm_compat`: the same bits as a fresh engine). Every returned token carries the
weight version that produced it; generating against a version other than the engine's raises.

vLLM reads its settings from the environment at import, so the engine sets
them (and records them in `provenance`) before the first import; one engine
per process.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .records import SamplingSpec

MODES = ("strict", "native")
ENGINES = ("rlkernel", "stock")


class StaleWeightsError(RuntimeError):
    """A request named a weight version the engine does not hold."""


TP_GRAPHS_ENV = "VIME_STRICT_TP_GRAPHS"


def graphs_proved(engine: str, tp: int) -> bool:
    """Whether an engine may run with CUDA graphs: stock vLLM always (its production default); the strict engine's
    decode graphs at rollout TP=1, the layout they are proved at. The one rule behind rollout.enforce_eager=null
    (roles.default_enforce_eager), `vime parity --cuda-graphs auto` and the refusal below.
    VIME_STRICT_TP_GRAPHS=1 lifts the TP=1 bound for the experiment that would prove it (`VIME_STRICT_TP_GRAPHS=1 vime
    parity --tp 2 --cuda-graphs on` on two GPUs: since session 30 the merges gather through vLLM's own communicator,
    which its graphs capture); `vime parity` reports it (`strict_tp_graphs_experiment`)."""
    return engine == "stock" or tp == 1 or tp_graphs_experiment()


def tp_graphs_experiment() -> bool:
    """Whether VIME_STRICT_TP_GRAPHS=1 asks for the strict engine's CUDA graphs at TP > 1 (graphs_proved)."""
    return os.environ.get(TP_GRAPHS_ENV) == "1"


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    model: str  # local HF checkpoint directory
    engine: str = "rlkernel"  # "rlkernel" (plugin) or "stock" (unmodified vLLM)
    mode: str = "strict"  # rlkernel policy inside the plugin's model: "strict" or "native"
    ops: tuple = ()  # rlkernel per-op overrides, ((op, "strict" | "native"), ...)
    dtype: str = "float32"
    temperature: float = 1.0  # rollout temperature (strict: applied inside the model)
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256  # < prompt lengths: chunked prefill mixes with decode
    block_size: int = 16  # stock vLLM on CPU needs a multiple of 32 (native mode)
    enable_prefix_caching: bool = True
    max_model_len: int = 1024
    kv_cache_gb: int = 1
    seed: int = 0
    in_process: bool = True  # engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    engine_id: str = "vllm-0"
    tp: int = 1  # vLLM's tensor parallelism (worker processes): stock layers, or the strict model's own TP layers
    gpu_memory_utilization: float | None = None  # on a GPU: vLLM's share of the device's memory (None: vLLM's default)
    row_segments: int | None = None  # the strict model's canonical K segments (rlkernel.row_segments: the trainer's); None: the model's default
    enforce_eager: bool = True  # False, on a GPU: CUDA graphs (stock: vLLM's compile + graphs; strict: decode graphs, no compile)
    # the strict engine on a GPU: the kernel manifest its model records into and compiles ahead from at start
    # (rlkernel/backends/triton/precompile.py; TP rank 0 records; at TP > 1 rank 0's workers compile, every rank preloads); None: neither
    kernel_manifest: str | None = None
    compile_workers: int | None = None
    kernel_manifest_seed: str | None = None  # a shipped seed whose "engine" entries merge into kernel_manifest first
    # further vllm.LLM keyword arguments, applied last (they override ours; recorded in provenance): for experiments such
    # as scripts/bench_rollout.py's runner variants. (("logprobs_mode", "raw_logprobs"),) on the strict engine reports
    # vLLM's log-softmax of the contract's logprobs: not the contract's bits
    engine_args: tuple = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"rollout mode must be one of {MODES}, got {self.mode!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"rollout engine must be one of {ENGINES}, got {self.engine!r}")
        if not Path(self.model, "config.json").exists():
            raise FileNotFoundError(f"no HF checkpoint (config.json) under {self.model!r}")
        if self.engine == "stock" and self.block_size % 32 and not torch.cuda.is_available():
            raise ValueError(f"stock vLLM on CPU needs block_size % 32 == 0, got {self.block_size}")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if not all(isinstance(kv, (tuple, list)) and len(kv) == 2 and isinstance(kv[0], str) for kv in self.engine_args):
            raise ValueError(f"engine_args must be (name, value) pairs of vllm.LLM arguments, got {self.engine_args!r}")
        if not self.enforce_eager and not graphs_proved(self.engine, self.tp):
            raise ValueError("the strict engine's CUDA graphs are proved at rollout TP=1 only; set enforce_eager "
                             f"(rollout.enforce_eager=true) for TP>1 (or {TP_GRAPHS_ENV}=1 to run the experiment that "
                             "would prove them)")


@dataclass(kw_only=True, slots=True)
class Completion:
    prompt_ids: list[int]  # [P]
    response_ids: list[int]  # [R]
    logprobs: np.ndarray  # [R] float32, the engine's logprob of each sampled token
    weight_version: int  # version that generated every token of this completion
    finish_reason: str  # "stop" / "length" / ...
    text: str = ""  # detokenised response
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(kw_only=True, slots=True)
class _Provenance:
    env: dict = field(default_factory=dict)
    engine_args: dict = field(default_factory=dict)
    start_seconds: float = 0.0


def _waves(lengths: list[int], budget: int, max_seqs: int) -> list[range]:
    """Contiguous runs of requests whose prompt tokens fit one scheduler step (<= budget) and whose count fits the
    engine (<= max_seqs): each run prefills whole, in its first step."""
    waves, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (used + n > budget or i - start >= max_seqs):
            waves.append(range(start, i))
            start, used = i, 0
        used += n
    if lengths:
        waves.append(range(start, len(lengths)))
    return waves


def _cpu_tp_env(tp: int) -> dict:
    """vLLM-CPU's tensor-parallel workers bind their OpenMP threads per NUMA node and refuse when there are fewer nodes
    than workers; with one node, the allowed cores are split into `tp` contiguous groups, one per worker
    (VLLM_CPU_OMP_THREADS_BIND="0|1" for two cores). A binding set by the user is kept. Nothing on a GPU platform."""
    import torch

    if torch.cuda.is_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"rollout tp={tp} needs at least {tp} CPU cores for vLLM's workers; this process may use {len(cores)}")
    per = len(cores) // tp
    groups = [cores[i * per:(i + 1) * per] for i in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups)}


def _scratch_dir(nbytes: int) -> str | None:
    """/dev/shm (memory) for a weight file of `nbytes` when it has room for it twice over (containers often give it
    64 MiB), else the default temporary directory."""
    import shutil

    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * nbytes:
        return "/dev/shm"
    return None


def _sweep_reload_dirs(folder: str) -> list[str]:
    """Remove the reload directories (`VLLMRollout._stock_reload`: a float32 copy of the model, in /dev/shm's memory
    where it fits) of engine processes that no longer run: an engine ended by `ray.kill` / `ray.shutdown` runs no
    atexit handler, so its last one stays behind. Returns the removed paths."""
    import shutil

    gone = []
    for d in Path(folder).glob("vime_reload_*_*"):
        try:
            pid = int(d.name.split("_")[2])
            os.kill(pid, 0)  # raises where no such process runs
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(str(d))
        except (ValueError, IndexError, PermissionError):  # not ours, or another user's running process
            continue
    return gone


class VLLMRollout:
    """Owns one vllm.LLM; generate / update_weights / weight_version."""

    def __init__(self, config: RolloutConfig):
        self.config = c = config
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if c.in_process else "1",
            "VLLM_PLUGINS": "rlkernel_strict" if c.engine == "rlkernel" else "",
            "VLLM_CPU_KVCACHE_SPACE": str(c.kv_cache_gb),
            # the sampler's rank helper is torch.compiled; compiling costs 8-45 s per start and changes no value we
            # report. Stock CUDA graphs (enforce_eager=False) need vLLM's compile; the strict engine never compiles
            # (Inductor would fuse the element-wise ops around rlkernel's kernels and round differently)
            "TORCHDYNAMO_DISABLE": "1" if c.enforce_eager or c.engine == "rlkernel" else "0",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        }
        if c.tp > 1:
            env.update(_cpu_tp_env(c.tp))
            if torch.cuda.is_available():  # this process has touched CUDA (rlkernel's kernels): forked workers could not use it
                env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        os.environ.update(env)
        from vllm import LLM

        from rlkernel.runtime import tune_cpu_allocator

        allocator = tune_cpu_allocator()

        args = dict(
            model=c.model, dtype=c.dtype, seed=c.seed, enforce_eager=c.enforce_eager, max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens, block_size=c.block_size,
            enable_prefix_caching=c.enable_prefix_caching, enable_chunked_prefill=True,
        )
        if c.gpu_memory_utilization is not None and torch.cuda.is_available():
            args.update(gpu_memory_utilization=c.gpu_memory_utilization)
        if c.tp > 1:
            args.update(tensor_parallel_size=c.tp, distributed_executor_backend="mp")
            if "VLLM_CPU_OMP_THREADS_BIND" in env:  # vLLM-CPU: its workers check this fraction of host memory (despite the name)
                args.update(gpu_memory_utilization=0.5)
        if c.engine == "rlkernel":
            from rlkernel.integrations.vllm_compat import contract_logprobs_mode
            from rlkernel.integrations.vllm_plugin import strict_architecture

            hf_archs = json.loads(Path(c.model, "config.json").read_text()).get("architectures")
            args.update(
                hf_overrides={"architectures": [strict_architecture(hf_archs)]},  # opt in: stock names stay stock
                logprobs_mode=contract_logprobs_mode(c.tp),  # raw_logits (V1, CPU) or raw_logprobs + the model's sampler wrapper (V2)
                worker_extension_cls="rlkernel.integrations.vllm_worker.StrictWorkerExtension",
                additional_config={"rlkernel": {"temperature": c.temperature, "mode": c.mode, "ops": dict(c.ops)}
                                   | ({} if c.row_segments is None else {"row_segments": c.row_segments})
                                   | ({} if not c.kernel_manifest else {"kernel_manifest": c.kernel_manifest,
                                                                        "compile_workers": c.compile_workers,
                                                                        "kernel_manifest_seed": c.kernel_manifest_seed})},
            )
            if not c.enforce_eager:
                # whole-step CUDA graphs of decode-only batches, captured from the eager model (no torch.compile):
                # the strict attention backend declares UNIFORM_SINGLE_TOKEN_DECODE; mixed batches run eagerly
                args.update(compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})
        else:
            args.update(logprobs_mode="processed_logprobs")
        args.update(dict(c.engine_args))
        t0 = time.perf_counter()
        self.llm = LLM(**args)
        self.provenance = _Provenance(env=env, engine_args={k: v for k, v in args.items() if k != "additional_config"} | {"rlkernel": asdict(c), "allocator": allocator},
                                      start_seconds=time.perf_counter() - t0)
        self.weight_version = 0
        # vLLM's loader keeps a tied head unless it is given: read once, for every weight update
        self._tied = bool(json.loads(Path(c.model, "config.json").read_text()).get("tie_word_embeddings", False))
        self.tokenizer = self.llm.get_tokenizer()
        if c.engine == "rlkernel":
            infos = self.llm.collective_rpc("rlkernel_info")  # one per worker (vLLM's TP ranks)
            for info in infos:
                if info["model_class"] not in ("StrictQwen3ForCausalLM", "StrictLlamaForCausalLM") or info["attention_impl"] != "StrictAttentionImpl":
                    raise RuntimeError(f"rlkernel plugin is not active in the engine: {info}")
                if info["logprobs_mode"] != "raw_logits" and not info["contract_sampler"]:
                    raise RuntimeError(f"the strict engine's reported logprobs would not be the contract's bits: {info}")
            self.provenance.engine_args["worker"] = infos[0] | {"workers": len(infos), "tp_ranks": sorted(tuple(i["tp"]) for i in infos),
                                                                "tp_gathers": sorted({str(i.get("tp_gather")) for i in infos})}

    def _params(self, spec: SamplingSpec, greedy: bool):
        from vllm import SamplingParams

        c = self.config
        if c.engine == "rlkernel" and spec.temperature != c.temperature:
            raise ValueError(f"the rlkernel engine samples at temperature {c.temperature} (set in RolloutConfig); got {spec.temperature}")
        temperature = 0.0 if greedy else (1.0 if c.engine == "rlkernel" else spec.temperature)
        return SamplingParams(temperature=temperature, top_p=spec.top_p, top_k=spec.top_k, max_tokens=spec.max_tokens,
                              logprobs=0, seed=spec.seed, ignore_eos=False)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec | Sequence[SamplingSpec], *,
                 weight_version: int | None = None, greedy: bool = False, use_tqdm: bool = False) -> list[Completion]:
        """One completion per prompt (repeat a prompt for a GRPO group)."""
        from vllm.inputs import TokensPrompt

        if weight_version is not None and weight_version != self.weight_version:
            raise StaleWeightsError(f"request for weight version {weight_version}, engine holds {self.weight_version}")
        specs = [sampling] * len(prompts) if isinstance(sampling, SamplingSpec) else list(sampling)
        if len(specs) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(specs)} sampling specs")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        budget = self.config.max_num_batched_tokens
        if not torch.cuda.is_available() and any(s.seed is not None and len(p) > budget for p, s in zip(prompts, specs)):
            # vLLM-CPU's sampler rewinds a seeded generator's offset when a prompt's prefill is split
            # across steps, which CPU generators do not support: it would crash deep in the engine
            longest = max(len(p) for p in prompts)
            raise ValueError(f"a seeded request's prompt has {longest} tokens, more than rollout.max_num_batched_tokens="
                             f"{budget}; vLLM-CPU cannot split a seeded prompt's prefill. Fix: set "
                             f"rollout.max_num_batched_tokens >= {longest} (or shorter prompts)")
        version = self.weight_version
        # The same crash hits a prompt that fits the budget but shares a step with others (the scheduler splits the
        # prompt that overflows the step). On the CPU, seeded requests therefore go in waves that each prefill whole in
        # one step (prompt tokens <= the budget, at most max_num_seqs); the strict engine's bits do not depend on the
        # batch, so the waves change no record, only how many sequences decode together.
        seeded_cpu = not torch.cuda.is_available() and any(s.seed is not None for s in specs)
        waves = _waves([len(p) for p in prompts], budget, self.config.max_num_seqs) if seeded_cpu else [range(len(prompts))]
        outs = []
        for wave in waves:
            outs += self.llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i in wave],
                                      [self._params(specs[i], greedy) for i in wave], use_tqdm=use_tqdm)
        result = []
        for prompt, o in zip(prompts, outs):
            out = o.outputs[0]
            lps = np.array([lp[tok].logprob for tok, lp in zip(out.token_ids, out.logprobs)], dtype=np.float32)
            result.append(Completion(prompt_ids=list(prompt), response_ids=list(out.token_ids), logprobs=lps, weight_version=version,
                                     finish_reason=str(out.finish_reason), text=out.text, cached_prompt_tokens=o.num_cached_tokens or 0))
        return result

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load HF-named tensors in place as `version` (> current) and drop cached KV. TP=1 with the engine core in this
        process: the worker is in this process too, so the tensors pass by reference (no file, no serialisation);
        TP>1 workers are processes of their own and read one file."""
        from safetensors.torch import save_file

        self._check_version(version)
        direct = self.config.tp == 1 and self.config.in_process
        if self.config.engine == "stock":
            if direct:
                from rlkernel.integrations import vllm_compat

                vllm_compat.reload_weights_from_tensors(self.llm, tensors, self._tied)
            else:
                self._stock_reload(tensors)
        elif direct:
            self._load_in_workers("rlkernel_load_tensors", tensors, version)
        else:
            with tempfile.TemporaryDirectory(dir=self._scratch(tensors)) as tmp:
                path = os.path.join(tmp, "model.safetensors")
                save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
                self._load_in_workers("rlkernel_load_weights", path, version)
        self._now_at(version)

    def update_weights_ipc(self, payloads: list[dict], version: int) -> None:
        """Like update_weights, from tensors trainer processes share as IPC handles: `payloads` holds, per TP rank of
        this engine, one trainer rank's {"device", "rank", "handles"} (vime.roles.handles_for_engines) made on that
        worker's own device — CUDA IPC on a colocated GPU (a device-to-device copy), shared memory on the CPU; nothing
        goes through a file. Each worker opens its own rank's (and checks the device): the strict engine through its
        worker extension; a stock engine through vLLM's `collective_rpc` running `stock_load_ipc`, which hands them to
        vLLM's own `reload_weights(weights_iterator=...)` where they are — no code of ours inside the engine otherwise
        (at TP=1 with the engine core in this process, that worker is in this process)."""
        self._check_version(version)
        if len(payloads) != self.config.tp:
            raise ValueError(f"update_weights_ipc: {len(payloads)} trainer ranks' handles for an engine of rollout.tp={self.config.tp}")
        if self.config.engine == "rlkernel":
            self._load_in_workers("rlkernel_load_ipc", payloads, version)
        else:
            from rlkernel.integrations.vllm_worker import stock_load_ipc

            got = self.llm.collective_rpc(stock_load_ipc, args=(payloads, self._tied))
            if sorted(g["tp_rank"] for g in got) != list(range(self.config.tp)):
                raise RuntimeError(f"the stock engine's weight update did not reach every TP rank: {got}")
        self._now_at(version)

    def write_checkpoint(self, tensors: dict[str, torch.Tensor], directory: str | Path) -> Path:
        """HF-named tensors as an HF checkpoint directory this engine's model could start from: its config and
        tokenizer files, the weights (the tied head written out explicitly)."""
        from rlkernel.integrations import vllm_compat

        from .checkpoint import copy_model_files

        Path(directory).mkdir(parents=True, exist_ok=True)
        copy_model_files(self.config.model, Path(directory))
        return vllm_compat.write_reload_checkpoint(tensors, directory, self._tied)

    def weight_digests(self) -> dict[str, str] | None:
        """{HF name: digest} of the weights the strict engine holds now (rlkernel.golden.digest: shape, dtype and bits);
        None for a stock engine (no worker extension of ours) or TP > 1 (each rank holds shards)."""
        if self.config.engine != "rlkernel" or self.config.tp != 1:
            return None
        return self.llm.collective_rpc("rlkernel_weight_digests")[0]

    def _check_version(self, version: int) -> None:
        if version <= self.weight_version:
            raise ValueError(f"weight versions must increase: engine holds {self.weight_version}, got {version}")

    def _load_in_workers(self, method: str, payload, version: int) -> None:
        got = self.llm.collective_rpc(method, args=(payload, version))
        if any(g["version"] != version for g in got):
            raise RuntimeError(f"weight update did not reach every worker: {got}")

    def _now_at(self, version: int) -> None:
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weight_version = version

    @staticmethod
    def _scratch(tensors: dict[str, torch.Tensor]) -> str | None:
        return _scratch_dir(sum(t.numel() * t.element_size() for t in tensors.values()))

    def _stock_reload(self, tensors: dict[str, torch.Tensor]) -> None:
        """vLLM's own in-place reload from a checkpoint directory; the directory stays until the next one
        (the engine's model config points at it after a reload)."""
        import shutil

        from rlkernel.integrations import vllm_compat

        scratch = self._scratch(tensors)
        if getattr(self, "_reload_dir", None) is None:  # this engine's first reload: the leftovers of killed ones go
            _sweep_reload_dirs(scratch or tempfile.gettempdir())
        new = vllm_compat.write_reload_checkpoint(tensors, tempfile.mkdtemp(prefix=f"vime_reload_{os.getpid()}_", dir=scratch),
                                                  self._tied)
        vllm_compat.reload_weights(self.llm, new)
        old, self._reload_dir = getattr(self, "_reload_dir", None), new
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        else:  # /dev/shm is memory: the last directory goes when the process ends
            import atexit

            atexit.register(lambda: shutil.rmtree(self._reload_dir, ignore_errors=True))

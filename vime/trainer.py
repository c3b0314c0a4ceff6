"""The training engine: Megatron-core on rlkernel's strict ops, scoring and GRPO updates.

What this module decides: how the trainer role owns a Megatron model (process groups,
determinism settings, weights in, weights out), what `score` returns (float32 logprobs
of every response token, the contract the rollout engine uses), and what one `update`
is (one GRPO step over the batch: a single forward/backward over the packed batch, grad
sync, global-norm clipping, one optimizer step, `weight_version += 1`).

Why this shape:
* Every forward and backward runs under `rlkernel.mode(config.mode, ops=...)`, so the
  strict/native arm and per-op ablations are one config field, not another model.
* Old logprobs are `batch.old_logprobs` when given, else the update's own forward,
  detached: with one optimizer step per batch that *is* the recompute (bitwise equal
  to `score` on the strict path), at no extra forward.
* A frozen reference copy exists only when `grpo.kl_coef > 0`.
* CPU (CI, laptops): torch AdamW over the model, and the grad sync Megatron's DDP would
  do, written here because that DDP needs CUDA: q/k-norm grads summed over TP (each rank
  sees only its heads), grads averaged over DP, a TP-aware global grad norm (sharded
  params summed over TP, replicated ones counted once). In strict mode these reductions
  use rlkernel's canonical tree, so they are bitwise run to run.
* CUDA: Megatron's DDP (all-reduce) + Megatron's mixed-precision optimizer (fp32 master
  weights); `finalize_model_grads` does the same sync; strict: rlkernel's TP-invariant norm and
  clipping over the DDP main grads. Run on H200s by scripts/gpu_trainer_check.py and
  scripts/gpu_tp_parity.py; no GPU in CI.
* Determinism (seed, torch threads, `torch.use_deterministic_algorithms`) is set by the
  engine, restored by `close()`, and recorded in `self.provenance`.
* bf16 without Megatron's optimizer (the CPU, and CUDA at CP > 1 or with token segments): torch AdamW over
  float32 master copies (`MasterWeightsAdamW`), the gradients gathered into them in float32.
* A non-finite loss or global grad norm stops the update before the optimizer steps
  (`NonFiniteUpdateError`, naming which inputs were non-finite): weights, optimizer state
  and version stay as they were, so a diverged step never becomes a weight version.
* `score_with_digest` also hashes what was actually fed to the model (vime.gate), so
  the controller can check it against the rollout's records.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import platform
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

import rlkernel as rk
from rlkernel.models.decoder import DecoderConfig, pack_sequences
from rlkernel import tree_sum
from rlkernel.parallel import token_segments

from .batch import Scored, TrainBatch
from .gate import ScoreDigest
from .grpo import GRPOConfig, combine_metrics, grpo_loss, read_metrics, token_count

_MODES = ("strict", "native")
_QK_NORMS = ("q_layernorm", "k_layernorm")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    mode: str = "strict"  # rlkernel mode of every forward/backward: "strict" | "native"
    ops: tuple = ()  # per-op overrides ((op, "strict" | "native"), ...); a dict is accepted
    tp: int = 1  # tensor-parallel size (world = tp * cp * dp)
    cp: int = 1  # context-parallel size: the packed token stream split across cp ranks (rlkernel.parallel.context_parallel)
    dtype: str = "float32"  # params and activations: "float32" | "bfloat16"
    device: str = "cpu"  # "cpu" (gloo, torch AdamW) or "cuda" (nccl, Megatron DDP + Megatron's optimizer)
    megatron_ddp: bool = True  # cuda: Megatron DDP + Megatron's optimizer; False (and always at cp > 1): the CPU path's explicit step
    seed: int = 0  # torch / python RNG seed, the same on every rank
    threads: int | None = None  # torch intra-op threads; None keeps the process setting
    deterministic: bool = True  # torch.use_deterministic_algorithms while the engine lives
    # torch.utils.deterministic.fill_uninitialized_memory while it lives. torch's default (True, under deterministic
    # algorithms) writes NaN into every fresh allocation: one kernel per torch.empty, 38% of the strict update's kernels
    # on an H200 (benchmarks/h200_update_profile.json). The kernels on both paths write every element they return, so
    # off by default; tests/test_megatron_training.py compares a poisoned (True) update with the default bit for bit.
    fill_uninitialized_memory: bool = False
    row_segments: int | None = None  # canonical K-segments of row-parallel GEMMs; None: DecoderConfig's default
    # canonical token segments of the update's backward (rlkernel.parallel.token_segments): 1 = off; S (a power of two,
    # a multiple of cp) = every sum over tokens per segment, merged by one tree, so CP=1, 2, ... S give the same bits
    token_segments: int = 1
    # the update's forwards and backwards (and scoring's forwards) take the batch in runs of whole samples of at most
    # this many tokens (TrainBatch.micro_batches), the gradients accumulated over them; 0: the whole batch at once
    micro_batch_tokens: int = 0
    lr: float = 1e-5
    betas: tuple = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  # max global grad norm; None: no clipping
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # a group of trainer processes (vime.executor's trainer group): this process's rank, the group's size and the
    # file:// store its ranks meet at (a file store: nothing listens on a port); world_size = tp (no data parallel)
    rank: int = 0
    world_size: int = 1
    init_method: str | None = None
    # cuda: the kernel manifest (rlkernel/backends/triton/precompile.py) this trainer records into and, when it exists
    # at start, compiles ahead from (compile_workers processes; None: the CPU count, at most 16); None: neither
    kernel_manifest: str | None = None
    compile_workers: int | None = None
    kernel_manifest_seed: str | None = None  # a shipped seed whose "trainer" entries merge into kernel_manifest first

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        ops = tuple(sorted(self.ops.items())) if isinstance(self.ops, Mapping) else tuple(tuple(o) for o in self.ops)
        object.__setattr__(self, "ops", ops)
        rk.ExecutionPolicy(mode=self.mode, ops=ops)  # validates op names
        if self.tp < 1 or self.cp < 1 or self.lr <= 0 or (self.threads is not None and self.threads < 1):
            raise ValueError("tp >= 1, cp >= 1, lr > 0 and threads >= 1 (or None) are required")
        if self.device not in ("cpu", "cuda") or self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"device must be cpu|cuda and dtype float32|bfloat16, got {self.device!r}, {self.dtype!r}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError("grad_clip must be > 0 or None")
        s = self.token_segments
        if s < 1 or s & (s - 1) or (s > 1 and s % self.cp):
            raise ValueError(f"token_segments must be a power of two and a multiple of cp={self.cp} (1: off), got {s}")
        if s > 1 and self.mode != "strict":
            raise ValueError("token_segments > 1 is the strict backward's contract: mode must be 'strict'")
        if s > 1 and self.grpo.entropy_coef:
            raise ValueError("token_segments > 1 with an entropy bonus (grpo.entropy_coef) is not supported: the entropy "
                             "head's gradient is not token-segmented; set entropy_coef=0 or token_segments=1")
        if not isinstance(self.micro_batch_tokens, int) or self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens must be an int >= 0 (0: the whole batch at once), got {self.micro_batch_tokens!r}")
        if self.world_size > 1 and (not 0 <= self.rank < self.world_size or not (self.init_method or "").startswith("file://")):
            raise ValueError(f"a group of {self.world_size} trainer processes needs 0 <= rank < world_size and a file:// init_method, "
                             f"got rank {self.rank}, init_method {self.init_method!r}")
        if self.grpo.entropy_coef and self.tp > 1:
            raise ValueError("entropy_coef > 0 needs the full-vocab entropy, implemented for tp=1 only (the vocab-parallel head has none yet)")


class MasterWeightsAdamW:
    """torch AdamW over float32 master copies of the model's parameters that are not float32 (the explicit step's
    mixed precision, as Megatron's optimizer keeps it): gradients gathered into the masters in float32 (`accumulate`,
    after each micro-batch's backward), the update made in float32, then rounded once into the parameter. Without it a
    bf16 parameter stepped in place drops every update below half its last place (lr 1e-6 on weights of ~0.02: all of
    them). float32 parameters are stepped as they are (the same bits as plain AdamW). state_dict holds the masters, so a
    resumed run continues from them, not from the rounded weights."""

    def __init__(self, params, **kw):
        self.params = list(params)
        self.masters = [p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self._master = {id(p): m for p, m in zip(self.params, self.masters)}
        self.inner = torch.optim.AdamW(self.masters, foreach=False, **kw)

    def holder(self, p):
        """Where `p`'s gradient lives at the step: its master (float32), or `p` itself when it is float32."""
        return self._master[id(p)]

    def accumulate(self) -> None:
        """Move every non-float32 parameter's gradient into its master's, adding in float32."""
        for p, m in zip(self.params, self.masters):
            if m is not p and p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)  # one rounding into the parameter's dtype

    def state_dict(self) -> dict:
        return {"adamw": self.inner.state_dict(), "masters": [m.detach() for p, m in zip(self.params, self.masters) if m is not p]}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["adamw"])
        with torch.no_grad():
            for m, saved in zip((m for p, m in zip(self.params, self.masters) if m is not p), state["masters"]):
                m.copy_(saved)


class NonFiniteUpdateError(FloatingPointError):
    """A GRPO step's loss or grad norm was NaN/inf; the optimizer was not stepped."""


def _cpu_kernels_status(device: str) -> dict | None:
    """Whether the strict ops run as rlkernel's CPU kernels here or as the composition (same bits)."""
    if device != "cpu":
        return None
    from rlkernel.backends import cpu

    return cpu.status()


def _gpu_kernels_status(device: str) -> dict | None:
    """The Triton kernels' golden check on this GPU (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    from rlkernel.backends import triton

    return triton.status()


class MegatronTrainer:
    """Trainer role: `load_hf`, `score`, `update`, `export_weights`; `close` (or `with`) tears down."""

    def __init__(self, config: TrainerConfig):
        from megatron.core import parallel_state

        self.config = config
        self._ps = parallel_state
        if parallel_state.model_parallel_is_initialized():
            raise RuntimeError("MegatronTrainer: megatron parallel_state is already initialised in this process")
        self._restore = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                         torch.utils.deterministic.fill_uninitialized_memory)
        self._owns_pg = not dist.is_initialized()
        try:  # on any failure, undo what was set up (close() handles partial state)
            self._setup()
        except BaseException:
            self.close()
            raise
        self.model = self.ref_model = self.spec = None
        self.weight_version = 0
        self.op_provenance = rk.ProvenanceCounter()  # rlkernel calls of score/update, taken per step
        self._qk_norms: list[torch.nn.Parameter] = []
        self._ddp = self.optimizer = None
        self.provenance = self._provenance()

    def _setup(self) -> None:
        c = self.config
        if c.threads is not None:
            torch.set_num_threads(c.threads)
        torch.use_deterministic_algorithms(c.deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = c.fill_uninitialized_memory
        if c.device == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if self._owns_pg:
            backend = "nccl" if c.device == "cuda" else "gloo"
            if c.world_size > 1:  # a trainer group (vime.executor): ranks meet at the group's file store
                dist.init_process_group(backend, init_method=c.init_method, rank=c.rank, world_size=c.world_size)
            elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
                dist.init_process_group(backend)
            else:  # a plain process, world 1: a file store (a tcp:// store listens on every interface, whatever host it is given)
                fd, self._store_file = tempfile.mkstemp(prefix="vime_pg_")
                os.close(fd)
                dist.init_process_group(backend, init_method=f"file://{self._store_file}", rank=0, world_size=1)
        self._ps.initialize_model_parallel(tensor_model_parallel_size=c.tp, context_parallel_size=c.cp)
        self.tp_group = self._ps.get_tensor_model_parallel_group()
        self.cp_group = self._ps.get_context_parallel_group() if c.cp > 1 else None
        self.dp_group = self._ps.get_data_parallel_group()
        if c.device == "cuda":
            self._compile_ahead()

    # ------------------------------------------------------------------ lifecycle
    def _policy(self, pack_weights: bool = False):
        return rk.mode(self.config.mode, ops=dict(self.config.ops), pack_weights=pack_weights)

    def _provenance(self) -> dict:
        import megatron.core

        c = self.config
        with self._policy():
            contracts = {op: rk.contract_for(op, device=c.device).contract_id for op in rk.OPS}
        return {
            "python": platform.python_version(), "torch": torch.__version__, "megatron_core": megatron.core.__version__,
            "device": c.device, "backend": dist.get_backend(), "world_size": dist.get_world_size(),
            "tp": self.tp_group.size(), "cp": c.cp, "token_segments": c.token_segments, "dp": self.dp_group.size(), "threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory, "seed": c.seed,
            "mode": c.mode, "ops": dict(c.ops), "dtype": c.dtype, "contracts": contracts,
            "cpu_kernels": _cpu_kernels_status(c.device),
            "gpu_kernels": _gpu_kernels_status(c.device),
            "kernel_manifest": c.kernel_manifest, "kernel_manifest_seed": c.kernel_manifest_seed,
            "compile_ahead": getattr(self, "compile_ahead_stats", None),
        }

    def _compile_ahead(self) -> None:
        """cuda + kernel_manifest: record every rlkernel kernel this trainer compiles (rank 0 writes the manifest after
        each new one); if the manifest exists, compile its entries first and preload them, so the first step's launches
        find them. In a group, rank 0's worker processes fill the shared disk cache once, then every rank preloads.
        kernel_manifest_seed: rank 0 first merges that seed's "trainer" entries into the manifest."""
        self.compile_ahead_stats = None
        path = self.config.kernel_manifest
        if not path:
            return
        from rlkernel.backends.triton import precompile

        rec, st = precompile.start_group(path, dist.get_rank(), dist.get_world_size(), dist.barrier, workers=self.config.compile_workers,
                                         log=lambda m: print(m, flush=True), seed=self.config.kernel_manifest_seed,
                                         role="trainer")
        self._kernel_recorder, self.compile_ahead_stats = rec, st

    def close(self) -> None:
        """Destroy parallel_state (and the process group if the engine created it); restore torch settings."""
        rec = getattr(self, "_kernel_recorder", None)  # (it wrote the manifest after each new compile)
        if rec is not None:
            rec.uninstall()
            self._kernel_recorder = None
        if self._ps.model_parallel_is_initialized():
            self._ps.destroy_model_parallel()
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
        if getattr(self, "_store_file", None):
            Path(self._store_file).unlink(missing_ok=True)
        threads, det, fill = self._restore
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
        torch.utils.deterministic.fill_uninitialized_memory = fill

    def __enter__(self) -> "MegatronTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ weights
    def load_hf(self, path: str | Path) -> None:
        """Build the model from an HF checkpoint directory (config.json + *.safetensors); version 0."""
        from safetensors.torch import load_file

        from rlkernel.integrations.megatron_spec import MegatronSpecConfig

        root, c = Path(path), self.config
        dec = DecoderConfig.from_hf(json.loads((root / "config.json").read_text()))
        if c.row_segments is not None:
            dec = dataclasses.replace(dec, row_segments=c.row_segments)
        summed = rk.ExecutionPolicy(mode=c.mode, ops=dict(c.ops)).choice("rms_norm") != "native"  # StrictHeadRMSNorm sums them
        self.spec = MegatronSpecConfig(decoder=dec, tp=c.tp, dtype=c.dtype, qk_norm_grads_summed=summed)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {root}")
        hf: dict[str, torch.Tensor] = {}
        for f in files:
            hf.update(load_file(str(f)))
        self.model = self._build(hf)
        self._qk_norms = [p for n, p in self.model.named_parameters() if any(k in n for k in _QK_NORMS)]
        if c.grpo.kl_coef:
            self.ref_model = self._build(hf).requires_grad_(False).eval()
        self._make_optimizer()
        self.weight_version = 0
        self.provenance.update(checkpoint=str(root), row_segments=dec.row_segments, padded_vocab=self.spec.padded_vocab)

    def load_weights(self, hf: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the policy's weights with HF-named tensors (e.g. a checkpoint) as `version`."""
        from rlkernel.integrations.megatron_convert import hf_to_megatron

        self._need_model()
        state = hf_to_megatron(dict(hf), self.spec, self.tp_group.rank())
        with torch.no_grad():
            self.model.load_state_dict(state, strict=True)
        self.weight_version = int(version)

    def _build(self, hf: Mapping[str, torch.Tensor]):
        from rlkernel.integrations.megatron_convert import hf_to_megatron
        from rlkernel.integrations.megatron_spec import build_model

        torch.manual_seed(self.config.seed)  # the same on every rank: CPU init builds identical master weights
        random.seed(self.config.seed)
        np.random.seed(self.config.seed % 2**32)  # every RNG stream of the process starts from the seed (a checkpoint saves them all)
        model = build_model(self.spec)
        model.load_state_dict(hf_to_megatron(hf, self.spec, self.tp_group.rank()), strict=True)
        return model.to(self.config.device)

    def take_provenance(self) -> dict:
        """rlkernel op calls since the last take: {op: [{backend, contract_id, device, calls}]}."""
        return self.op_provenance.take()

    def export_weights(self, version: int, device: str = "cpu", keep: bool = True) -> dict[str, torch.Tensor]:
        """Full HF-named state dict (gathered over TP, vocab padding dropped) of weight version `version`, on the CPU
        (device="cuda": on the model's device, gathered there — what a colocated engine opens through CUDA IPC).
        keep=False: this rank takes part in the TP gathers and returns {} (its group's rank 0 returns the weights)."""
        from rlkernel.integrations.megatron_convert import gather_shards, megatron_to_hf

        self._need_model()
        if version != self.weight_version:
            raise ValueError(f"export_weights: asked for version {version}, the model is at {self.weight_version}")
        local = {k: v.detach() for k, v in self.model.state_dict().items()}
        shards = gather_shards(local, dict(self.model.named_parameters()), self.tp_group, keep_device=device != "cpu")
        return megatron_to_hf(shards, self.spec, keep=keep)

    # ------------------------------------------------------------------ scoring
    def _need_model(self):
        if self.model is None:
            raise RuntimeError("MegatronTrainer: call load_hf(path) first")

    def _pack(self, batch: TrainBatch):
        """(flat ids [T], cu_seqlens [B+1], scored rows [R]): row i predicts token ids[i + 1]."""
        ids, cu = pack_sequences(batch.sequences, self.config.device)
        starts = itertools.accumulate((len(q) for q in batch.sequences), initial=0)  # on the host: no read-back of cu
        rows = [i for s, p, q in zip(starts, batch.prompt_lens, batch.sequences) for i in range(s + p - 1, s + len(q) - 1)]
        return ids, cu, torch.tensor(rows, dtype=torch.long, device=ids.device)  # one copy, not an arange per sample

    def _response_logprobs(self, model, batch: TrainBatch, entropy: bool = False, packed=None):
        """Per-sample logprobs of response tokens; with entropy=True also the flat [R] entropy
        of the policy at those positions (tp=1: the strict tile-by-tile linear_entropy)."""
        ids, cu, rows = packed if packed is not None else self._pack(batch)
        longest = max(len(s) for s in batch.sequences)  # on the host: attention needs no read-back of cu
        hidden, rows_l, local, gather = self._local_forward(model, ids, cu, rows, longest)
        with self._head_rows(hidden.shape[0], rows_l):
            lp = gather(model.logprobs(hidden[rows_l], ids[rows + 1][local], batch.temperature).float())
        lp = list(lp.split(batch.response_lens))
        if not entropy:
            return lp
        vocab, tp = self.spec.decoder.vocab_size, self.tp_group.size()
        if tp == 1:
            return lp, gather(rk.linear_entropy(hidden[rows_l], model.output_weight, batch.temperature, vocab_size=vocab))
        if rk.current_policy().choice("linear_logprob") == "native":
            return lp, None  # no native vocab-parallel entropy: the metric is absent (null), never made up
        with torch.no_grad():  # a metric only at TP>1 (config refuses an entropy bonus there): bitwise the TP=1 value
            ent = rk.vocab_parallel_entropy(hidden[rows_l].detach(), model.output_weight.detach(), vocab_start=self.tp_group.rank() * self.spec.padded_vocab // tp,
                                            vocab_size=vocab, temperature=batch.temperature, group=self.tp_group,
                                            check=False)  # rank * rows: the ranges computed, not gathered
        return lp, gather(ent)

    def _local_forward(self, model, ids, cu, rows, longest: int | None = None):
        """(hidden states of this rank's tokens, the scored rows among them as local indices, the mask of those rows
        among all scored rows, a function joining
        per-row results of every CP rank in global row order). CP=1: the whole stream. CP>1: the stream padded
        to a multiple of cp (a padding sequence, never scored), rank r holding tokens [r*T_l, (r+1)*T_l). Under token
        segments (an update with trainer token_segments=S > 1): padded to a multiple of S, at CP=1 too."""
        cp = self.config.cp
        segmented = token_segments.current() is not None and torch.is_grad_enabled()
        mult = self.config.token_segments if segmented else cp  # token segments: S equal slices of the padded stream
        total = ids.shape[0]
        padded = -(-total // mult) * mult
        if padded > total:  # a padding sequence, never scored
            ids = torch.cat([ids, torch.zeros(padded - total, dtype=ids.dtype, device=ids.device)])
            cu = torch.cat([cu, cu.new_tensor([padded])])
        if longest is not None:  # the host's longest sequence (a padding sequence may be longer)
            longest = max(longest, padded - total)
        if cp == 1:  # the whole stream (under token segments: padded, attention by pieces)
            return model.hidden_states(ids, cu, max_seqlen=longest), rows, torch.ones_like(rows, dtype=torch.bool), (lambda x: x)
        from rlkernel.parallel.context_parallel import GatherRows

        per = padded // cp
        rank = torch.distributed.get_rank(self.cp_group)
        offset = rank * per
        hidden = model.hidden_states(ids[offset:offset + per], cu, cp=(offset, self.cp_group))
        counts = tuple(int(((rows >= r * per) & (rows < (r + 1) * per)).sum()) for r in range(cp))
        local = (rows >= offset) & (rows < offset + per)
        return hidden, rows[local] - offset, local, (lambda x: GatherRows.apply(x, counts, self.cp_group))

    def _head_rows(self, local_tokens: int, rows_l: torch.Tensor):
        """Under token segments: the segments(...) block telling the logprob head how many of its rows (rows_l, local
        token indices in order) fall in each of this rank's segments; else nothing."""
        state = token_segments.current()
        if state is None or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        seg = local_tokens // state.n_local
        edges = torch.arange(1, state.n_local, device=rows_l.device) * seg
        splits = torch.bincount(torch.bucketize(rows_l, edges, right=True), minlength=state.n_local)
        return token_segments.segments(state.n_local, splits.tolist())

    def score(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Per sample, float32 log p(response token | prefix) at batch.temperature, under the current weights."""
        return self.score_with_digest(batch).logprobs

    def score_with_digest(self, batch: TrainBatch) -> Scored:
        """`score`, plus the version and a digest of the tensors the model was actually fed."""
        from rlkernel.integrations.megatron_spec import positions_from_cu_seqlens

        self._need_model()
        ids, cu, rows = packed = self._pack(batch)
        # scoring may reuse packed weights: the optimizer updates them in place (version moves)
        with torch.no_grad(), self._policy(pack_weights=True), self.op_provenance.collect():
            self.model.eval()
            mbs = batch.micro_batches(self.config.micro_batch_tokens)
            lps = [t.cpu() for mb in mbs for t in self._response_logprobs(self.model, mb, packed=packed if len(mbs) == 1 else None)]
        pos = positions_from_cu_seqlens(cu)  # the positions StrictCoreAttention rotates by
        digest = ScoreDigest.of(tokens=ids.cpu(), lengths=(cu[1:] - cu[:-1]).cpu(), positions=pos.cpu(), scored_positions=pos[rows].cpu(),
                                targets=ids[rows + 1].cpu(), loss_mask=torch.cat(batch.loss_mask).cpu(),
                                vocab_size=self.model.output_layer.vocab_size, versions=[self.weight_version] * int(rows.numel()))
        return Scored(logprobs=lps, weight_version=self.weight_version, digest=digest)

    # ------------------------------------------------------------------ training
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One GRPO step on `batch`; returns metrics and bumps weight_version."""
        self._need_model()
        g, dev = self.config.grpo, self.config.device
        if batch.advantages is None or batch.advantages.shape != (len(batch.sequences),):
            raise ValueError("update: batch.advantages must be a [B] tensor")
        mask = torch.cat(batch.loss_mask).to(dev)
        mbs = batch.micro_batches(self.config.micro_batch_tokens)
        denominator = token_count(mask) if len(mbs) > 1 else None  # (one micro-batch: grpo_loss's own, the same value)
        s = self.config.token_segments
        segmented = token_segments.segments(s // self.config.cp) if s > 1 else contextlib.nullcontext()
        with self._policy(), self.op_provenance.collect(), segmented:
            self.model.train()
            if self._ddp is not None:
                self._ddp.zero_grad_buffer()
            self.optimizer.zero_grad(set_to_none=True)
            token_segments.clear(self.model.parameters())  # nothing pending from an update that raised
            if g.tis_cap is not None and batch.rollout_logprobs is None:
                raise ValueError("update: tis_cap is set but the batch has no rollout_logprobs")
            # one forward and backward per micro-batch (trainer micro_batch_tokens; one: the whole batch), the
            # gradients accumulated in order; every mean over tokens divides by the whole batch's token count, so the
            # losses and metrics add up to the batch's (combine_metrics)
            losses, parts, inputs = [], [], []
            for mb in mbs:
                lps, entropy = self._response_logprobs(self.model, mb, entropy=True)
                lp = torch.cat(lps)
                if entropy is not None and not g.entropy_coef:  # the bonus needs its gradient (TP=1); the metric is free of it
                    entropy = entropy.detach()
                old = torch.cat(mb.old_logprobs).to(dev) if mb.old_logprobs is not None else lp.detach()
                ref = roll = None
                if g.kl_coef:
                    with torch.no_grad():
                        ref = torch.cat(self._response_logprobs(self.ref_model, mb))
                if g.tis_cap is not None:
                    roll = torch.cat(mb.rollout_logprobs).to(dev)
                adv = torch.repeat_interleave(mb.advantages.float(), torch.tensor(mb.response_lens)).to(dev)
                # the metrics stay on the device until the step is done, and the loss is checked once the backward is
                # launched: no read-back between the forward and the backward (the host launches the backward while the
                # device still runs the forward); a non-finite loss still stops the update before the optimizer steps
                loss, metrics = grpo_loss(lp, old, adv, torch.cat(mb.loss_mask).to(dev), g, ref_logprobs=ref, rollout_logprobs=roll,
                                          entropy=entropy, read_back=False, denominator=denominator)
                inputs.append({"advantages": mb.advantages, "old_logprobs": old, "logprobs": lp.detach(), "ref_logprobs": ref,
                               "rollout_logprobs": roll})
                loss.backward()
                if isinstance(self.optimizer, MasterWeightsAdamW):  # bf16 gradients summed over micro-batches in float32
                    self.optimizer.accumulate()
                losses.append(loss.detach())
                parts.append(metrics)
            loss, metrics = losses[0], combine_metrics(parts)
            for more in losses[1:]:
                loss = loss + more
            def joined() -> dict:  # the micro-batches' inputs as the batch's (for the error's census)
                return {k: None if inputs[0][k] is None else torch.cat([i[k] for i in inputs]) for k in inputs[0]}

            if not torch.isfinite(loss):
                raise NonFiniteUpdateError(self._nonfinite("loss", loss.item(), joined()))
            grad_norm = self._cuda_step() if self._ddp is not None else self._cpu_step()
            if not math.isfinite(grad_norm):  # _cpu_step refuses to step on it; Megatron's DDP checks before its step
                raise NonFiniteUpdateError(self._nonfinite("global grad norm", grad_norm, joined()))
        self.weight_version += 1
        metrics = read_metrics({**metrics, "loss": loss.detach()})  # one read, after the step
        metrics.update(grad_norm=grad_norm, weight_version=self.weight_version, tokens=int(mask.numel()), micro_batches=len(mbs),
                       time_compile=self._compile_seconds())
        return metrics

    def _compile_seconds(self) -> float | None:
        """Wall seconds this trainer spent in first launches of rlkernel's Triton kernels since the previous update (so
        the step's score and update; the first step's figure counts from the trainer's start): Triton compiling them,
        or loading them from its disk cache. None off CUDA (no Triton kernels run)."""
        if self.config.device != "cuda":
            return None
        from rlkernel.backends.triton.launch import first_launch_stats

        total = first_launch_stats()["seconds"]
        delta, self._compile_mark = total - getattr(self, "_compile_mark", 0.0), total
        return round(delta, 3)

    def _nonfinite(self, what: str, value: float, inputs: dict) -> str:
        self.optimizer.zero_grad(set_to_none=True)
        bad = ", ".join(f"{k} {int((~torch.isfinite(v)).sum())}/{v.numel()}" for k, v in inputs.items() if v is not None)
        return (f"GRPO update at weight version {self.weight_version}: the {what} is {value}; the optimizer was not stepped "
                f"(weights, optimizer state and version unchanged) and the run stops. Non-finite inputs: {bad}. "
                "Fix the source (NaN rewards or advantages, NaN weights in the checkpoint, or a trainer.lr too large), "
                "then resume from the last checkpoint (run.resume=true).")

    def _make_optimizer(self) -> None:
        c = self.config
        # CP>1: the explicit step on every device (it sums each rank's token-partial grads over the CP group by the tree;
        # Megatron's DDP would average them over DP x CP instead)
        if c.device == "cuda" and c.megatron_ddp and c.cp == 1 and c.token_segments == 1:  # Megatron DDP + its optimizer
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            # check_for_nan_in_grad: Megatron raises on a NaN/inf grad before its optimizer steps. DDP all-reduces the
            # grads and Megatron's (non-distributed) optimizer keeps fp32 master weights: the two must agree on
            # use_distributed_optimizer (a reduce-scattering DDP under a non-distributed optimizer steps every DP rank
            # on partly unreduced grads: found on two H200s, benchmarks/H200_NOTES.md). Strict: the global norm and the
            # clipping are ours (TP invariant, `_cuda_step`), so Megatron's clipping is off.
            ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True, check_for_nan_in_grad=True)
            self._ddp = DistributedDataParallel(config=self.model.config, module=self.model, ddp_config=ddp_cfg)
            clip = 0.0 if c.mode == "strict" else (c.grad_clip or 0.0)
            opt_cfg = OptimizerConfig(optimizer="adam", lr=c.lr, weight_decay=c.weight_decay, adam_beta1=c.betas[0], adam_beta2=c.betas[1],
                                      adam_eps=c.adam_eps, clip_grad=clip, bf16=c.dtype == "bfloat16", use_distributed_optimizer=False)
            self.optimizer = get_megatron_optimizer(opt_cfg, [self._ddp])
            return
        kw = dict(lr=c.lr, betas=tuple(c.betas), eps=c.adam_eps, weight_decay=c.weight_decay)
        if all(p.dtype == torch.float32 for p in self.model.parameters()):
            self.optimizer = torch.optim.AdamW(self.model.parameters(), foreach=False, **kw)
        else:  # bf16: float32 master weights (MasterWeightsAdamW), as Megatron's optimizer on the DDP path
            self.optimizer = MasterWeightsAdamW(self.model.parameters(), **kw)

    def _cuda_step(self) -> float:
        """Megatron's finalize_model_grads, then its optimizer. Strict: the global grad norm is rlkernel's
        canonical_grad_norm over the DDP main grads and the clipping is applied here (Megatron's own norm sums the
        ranks' shards in an order that depends on the TP size), so a TP=2 step can equal a TP=1 step bit for bit."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self._ddp])
        if self.config.mode != "strict":
            _, grad_norm, _ = self.optimizer.step()
            return float(grad_norm or 0.0)
        from rlkernel.parallel.tp_backward import canonical_grad_norm

        norm = canonical_grad_norm(self.model.named_parameters(), self.tp_group, grad=lambda p: getattr(p, "main_grad", None))
        grads = [p.main_grad for p in self.model.parameters() if getattr(p, "main_grad", None) is not None]
        return self._clip_and_step(norm, grads)

    def _clip_and_step(self, norm: torch.Tensor, grads: list[torch.Tensor]) -> float:
        """Scale `grads` to the global norm limit (grad_clip) and step the optimizer; a non-finite norm steps nothing."""
        if not torch.isfinite(norm):
            return norm.item()  # update() raises before anything is stepped
        if self.config.grad_clip is not None:
            coef = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
            by_kind: dict[tuple, list[torch.Tensor]] = {}
            for g in grads:
                by_kind.setdefault((g.dtype, g.device), []).append(g)
            for (dtype, device), gs in by_kind.items():  # one multiply per element either way: the same bits, fewer launches
                torch._foreach_mul_(gs, coef.to(device=device, dtype=dtype))
        self.optimizer.step()
        return norm.item()

    def _reduce(self, t: torch.Tensor, group) -> torch.Tensor:
        if group.size() == 1:
            return t
        if self.config.mode == "strict":  # every rank holds the same parameters: no shape check (a host wait a call on a GPU)
            return rk.tree_all_reduce([t], group, check=False)
        return rk.native_all_reduce([t], group)

    def _cpu_step(self) -> float:
        """Megatron's finalize_model_grads + clip_grad_norm, for a model without DDP; then AdamW. Strict: the grad norm
        is TP invariant (rlkernel's canonical_grad_norm; the q/k-norm grads are already summed over TP by their
        layer), so a TP=2 step equals a TP=1 step bit for bit."""
        from rlkernel.parallel.tp_backward import canonical_grad_norm

        # token segments: the weights' gradients wait as per-segment partials; merged here over the rank's segments and
        # the CP ranks by one tree (already summed over CP: the loop below skips them)
        merged = {id(p) for p in token_segments.finalize(self.model.parameters(), self.cp_group)}
        # where each gradient lives from here: the parameter, or its float32 master (bf16 parameters)
        masters = isinstance(self.optimizer, MasterWeightsAdamW)
        if masters:
            self.optimizer.accumulate()
        h = self.optimizer.holder if masters else (lambda p: p)  # noqa: E731
        params = [p for p in self.model.parameters() if h(p).grad is not None]
        strict = self.config.mode == "strict"
        policy = rk.ExecutionPolicy(mode=self.config.mode, ops=dict(self.config.ops))
        if policy.choice("rms_norm") == "native":
            for p in self._qk_norms:  # replicated, but each TP rank's grad covers only its own heads
                if h(p).grad is not None:
                    h(p).grad = self._reduce(h(p).grad, self.tp_group)
        if self.cp_group is not None:  # each CP rank's grads cover its own tokens (and, through the key/value gather, the
            for p in params:           # others' queries): their sum over ranks, by the canonical tree on the strict path
                if id(p) not in merged:
                    h(p).grad = self._reduce(h(p).grad, self.cp_group)
        dp = self.dp_group.size()
        if dp > 1:
            for p in params:
                h(p).grad = self._reduce(h(p).grad, self.dp_group) / dp
        if strict:
            norm = canonical_grad_norm(self.model.named_parameters(), self.tp_group, grad=lambda p: h(p).grad)
        else:
            sharded = [p for p in params if getattr(p, "tensor_model_parallel", False)]
            replicated = [p for p in params if not getattr(p, "tensor_model_parallel", False)]

            def sq(ps):
                parts = [tree_sum(h(p).grad.float().square().reshape(-1), dim=0) for p in ps]
                return tree_sum(torch.stack(parts), dim=0) if parts else torch.zeros((), device=self.config.device)

            norm = torch.sqrt(self._reduce(sq(sharded).reshape(1), self.tp_group)[0] + sq(replicated))
        return self._clip_and_step(norm, [h(p).grad for p in params])

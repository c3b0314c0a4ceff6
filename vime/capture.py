"""Per-op activations of the real engines on frozen tokens (for `vime diagnose`).

What this module decides: what is observed in each engine and how its rows are lined up.
Both engines run in this process, each under its own rlkernel policy and thread count, with
torch forward hooks on their real modules and rlkernel's op tap (`rlkernel.dispatch.tap`)
for the ops that are not modules (RoPE, SwiGLU, the logprob head inside vLLM's
`compute_logits`, attention inside Megatron's core attention). Nothing is re-implemented:
every value is what the engine computed.

* vLLM: the strict model classes through the plugin, in-process, prefix caching off (so every
  row is computed), the run's scheduler limits. The frozen response is forced token by token
  with a logits processor (vLLM's official extension point; logprobs are taken from the raw
  logits before it runs), so the prompt goes through chunked prefill and the response through
  decode against the paged KV cache — the rollout's own path. A step's rows are split by the
  attention metadata's `query_start_loc` and assigned to sequences through the runner's batch
  order and each request's own SamplingParams (`extra_args["vime_seq"]`); the tokens fed are
  checked against the frozen ones. (Reading the runner's batch is read-only; nothing in vLLM
  is patched.)
* Megatron-core: the rlkernel layer spec, one packed forward of the same sequences, as the
  trainer scores. Fused QKV and fc1 outputs are split into the HF q/k/v and gate/up columns (so are the vLLM
  model's fused q/k/v and gate/up GEMMs, `StrictDecoder.fuse_projections`).

A site is one op call per layer (`q_proj`, `rope_q`, `attention`, ...); each side stores, per
sequence and position, the site's input and output rows (float32 copies: bf16 is exact).
"""
from __future__ import annotations

import os

import torch

import rlkernel as rk

# forward order inside a layer; the op each site runs (None: not an rlkernel op)
LAYER_SITES = (("input_layernorm", "rms_norm"), ("q_proj", "linear"), ("k_proj", "linear"), ("v_proj", "linear"),
               ("q_norm", "rms_norm"), ("k_norm", "rms_norm"), ("rope_q", "rope"), ("rope_k", "rope"), ("attention", "attention"),
               ("o_proj", "linear"), ("post_attention_layernorm", "rms_norm"), ("gate_proj", "linear"), ("up_proj", "linear"),
               ("swiglu", "swiglu"), ("down_proj", "linear"), ("layer_output", None))
HEAD_SITES = (("final_norm", "rms_norm"), ("logprob", "linear_logprob"))


class Sites:
    """One engine's captured rows: (site, "in"|"out") -> per sequence a [L, F] float32 buffer + filled mask."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        self.data: dict[tuple, list] = {}
        self.filled: dict[tuple, list] = {}
        self.rows: list[tuple[int, torch.Tensor]] = []  # this forward's (sequence, positions) per chunk, in row order
        self.layer = -1
        self.rope_calls = 0
        self.on_logprob = None  # callback for the logprob head's rows (their positions are engine-specific)
        self.sbh = False  # Megatron's [s, b, h] activations: squeeze the batch dim of 1
        self.kernels: dict[tuple[int, str], dict[str, int]] = {}  # (layer or -1, op) -> {kernel named: calls}

    def put(self, site: str, kind: str, x: torch.Tensor) -> None:
        """Scatter rows of x (the current forward's rows, in order) to their sequences and positions."""
        x = x.detach().reshape(x.shape[0], -1).float()
        start = 0
        for seq, pos in self.rows:
            self.put_rows(site, kind, seq, pos, x[start:start + len(pos)])
            start += len(pos)

    def put_rows(self, site, kind, seq, pos, rows):
        key = (site, kind)
        if key not in self.data:
            self.data[key] = [None] * len(self.lengths)
            self.filled[key] = [torch.zeros(n, dtype=torch.bool) for n in self.lengths]
        buf = self.data[key]
        if buf[seq] is None:
            buf[seq] = torch.zeros(self.lengths[seq], rows.shape[1])
        pos = pos.cpu()  # the buffers live on the host whatever device the engine runs on (a GPU's rows come over)
        buf[seq][pos] = rows.detach().reshape(len(pos), -1).float().cpu()
        self.filled[key][seq][pos] = True

    def site(self, name: str) -> str:
        return f"{self.layer}.{name}" if self.layer >= 0 else name


def _ready() -> None:
    """Load the CPU kernels (and run their golden self-check) before any tap is on; not on a GPU machine, where the
    engines run the Triton kernels (a CPU side's first call would load them under the tap, which skips calls that are
    not the model's forward)."""
    from rlkernel.backends import cpu

    if torch.cuda.is_available():
        return
    cpu.available()


def _tap(sites: Sites, ops: tuple):
    def fn(op, impl, tensors, out):
        n = sum(len(p) for _, p in sites.rows)
        if op != "linear_logprob" and (sites.layer < 0 or tensors[0].shape[0] != n):
            return  # not a call of the model's forward (a load-time self-check, say)
        for note in rk.dispatch.kernel_notes():  # every op's kernels, the module-hooked ones too
            calls = sites.kernels.setdefault((sites.layer if op != "linear_logprob" else -1, op), {})
            calls[note] = calls.get(note, 0) + 1
        if op not in ops:
            return
        if op == "rope":
            name = "rope_q" if sites.rope_calls % 2 == 0 else "rope_k"
            sites.rope_calls += 1
            sites.put(sites.site(name), "in", tensors[0])
            sites.put(sites.site(name), "out", out)
        elif op == "swiglu":
            sites.put(sites.site("swiglu"), "in", torch.cat([t.reshape(t.shape[0], -1) for t in tensors], 1))
            sites.put(sites.site("swiglu"), "out", out)
        elif op == "attention":
            sites.put(sites.site("attention"), "in", torch.cat([t.reshape(t.shape[0], -1) for t in tensors], 1))
            sites.put(sites.site("attention"), "out", out)
        elif op == "linear_logprob" and sites.on_logprob is not None:
            sites.on_logprob(tensors, out)
    return fn


def _hook(sites: Sites, name: str, split=None, with_input: bool = True):
    """A forward hook storing the module's first input and its output (first element of a tuple) at site `name`."""
    def rows(t, n):
        if sites.sbh and t.dim() >= 3 and t.shape[1] == 1:
            t = t.squeeze(1)
        return t[:n]

    def fn(module, args, out):
        y = out[0] if isinstance(out, tuple) else out
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        n = sum(len(p) for _, p in sites.rows)
        y = rows(y, n)
        if x is not None:
            x = rows(x, n)
        parts = split(y) if split else {name: y}
        for site, val in parts.items():
            sites.put(sites.site(site), "out", val)
            if with_input and x is not None:
                sites.put(sites.site(site), "in", x)
    return fn


def _layer_pre(sites: Sites, i: int):
    def fn(module, args):
        sites.layer, sites.rope_calls = i, 0
    return fn


def _head_pre(sites: Sites):
    def fn(module, args):
        sites.layer = -1
    return fn


# ---------------------------------------------------------------------------------------------- vLLM
class ForcedTokens:
    """vLLM logits processor: a request whose SamplingParams.extra_args carry `vime_forced`
    (token ids) samples exactly those tokens, one per step. Loaded through LLM(logits_processors=...)."""

    @classmethod
    def validate_params(cls, sampling_params):
        return None

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows: dict[int, tuple[list, list]] = {}  # batch index -> (forced ids, the request's live output ids)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        from vllm.v1.sample.logits_processor import MoveDirectionality

        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, _, out in batch_update.added:
            forced = (params.extra_args or {}).get("vime_forced") if params is not None else None
            if forced is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = (list(forced), out)
        for a, b, kind in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if kind == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, (forced, out) in self.rows.items():
            n = len(out)
            if n < len(forced):
                logits[i].fill_(float("-inf"))
                logits[i, forced[n]] = 0.0
        return logits


def _make_forced_cls():
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return type("VimeForcedTokens", (ForcedTokens, LogitsProcessor), {"__module__": __name__})


def vllm_engine(model: str, *, mode: str, ops: dict, dtype: str, temperature: float, max_num_seqs: int, max_num_batched_tokens: int,
                block_size: int, max_model_len: int, seed: int, row_segments: int | None = None):
    """An in-process vLLM with the rlkernel plugin (as vime.rollout builds it), no prefix cache, forced-token sampling."""
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "rlkernel_strict", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "TORCHDYNAMO_DISABLE": "1", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")})
    import json
    from pathlib import Path

    from vllm import LLM

    from rlkernel.integrations.vllm_plugin import strict_architecture

    archs = json.loads(Path(model, "config.json").read_text()).get("architectures")
    return LLM(model=model, hf_overrides={"architectures": [strict_architecture(archs)]}, dtype=dtype, seed=seed, enforce_eager=True,
               max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, enable_prefix_caching=False,
               enable_chunked_prefill=True, logprobs_mode="raw_logits", logits_processors=[_make_forced_cls()],
               worker_extension_cls="rlkernel.integrations.vllm_worker.StrictWorkerExtension",
               additional_config={"rlkernel": {"temperature": temperature, "mode": mode, "ops": dict(ops)}
                                  | ({} if row_segments is None else {"row_segments": row_segments})})


def _vllm_model(worker):
    return worker.model_runner.get_model()


def _vllm_runner(worker):
    return worker.model_runner


def capture_vllm(llm, sequences: list[list[int]], prompt_lens: list[int], threads: int) -> tuple[Sites, list]:
    """Prefill each prompt, decode its frozen response (forced), hooks on every op; returns (sites, per-sequence logprobs)."""
    from vllm import SamplingParams
    from vllm.forward_context import get_forward_context
    from vllm.inputs import TokensPrompt

    _ready()
    model, runner = llm.collective_rpc(_vllm_model)[0], llm.collective_rpc(_vllm_runner)[0]
    sites = Sites([len(s) for s in sequences])

    def seq_of(req_id: str, ids: list[int], start: int) -> int:
        # each request carries its sequence index in its own SamplingParams (extra_args), which the runner keeps
        j = runner.requests[req_id].sampling_params.extra_args["vime_seq"]
        if sequences[j][start:start + len(ids)] != ids:
            raise RuntimeError(f"vime diagnose: vLLM fed other tokens than sequence {j}'s at positions {start}..{start + len(ids) - 1}")
        return j

    def pre_forward(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        pos = (kwargs["positions"] if "positions" in kwargs else args[1]).long()
        md = next(iter(get_forward_context().attn_metadata.values()))
        qsl = md.query_start_loc.tolist()
        reqs = runner.input_batch.req_ids[: len(qsl) - 1]  # the batch's requests, in row order
        sites.rows = [(seq_of(rid, ids[a:b].tolist(), int(pos[a])), pos[a:b].clone()) for rid, a, b in zip(reqs, qsl[:-1], qsl[1:])]
        sites.layer = -1

    def on_logprob(tensors, out):  # compute_logits: one row per request, its chunk's last position
        for r, (j, pos) in enumerate(sites.rows[: out.shape[0]]):
            p = int(pos[-1])
            if p + 1 < len(sequences[j]):
                sites.put_rows("logprob", "out", j, torch.tensor([p]), out[r, sequences[j][p + 1]].reshape(1, 1))
                sites.put_rows("logprob", "in", j, torch.tensor([p]), tensors[0][r].reshape(1, -1))

    sites.on_logprob = on_logprob
    handles = [model.register_forward_pre_hook(pre_forward, with_kwargs=True)]
    handles += _hooks_vllm(model, sites)
    params = [SamplingParams(temperature=1.0, max_tokens=len(s) - p, logprobs=0, ignore_eos=True,
                             extra_args={"vime_forced": list(s[p:]), "vime_seq": j}) for j, (s, p) in enumerate(zip(sequences, prompt_lens))]
    set_threads, old = torch._C.set_num_threads, torch.get_num_threads()
    set_threads(threads)
    try:
        with rk.dispatch.tap(_tap(sites, ("rope", "swiglu", "linear_logprob"))):
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(s[:p])) for s, p in zip(sequences, prompt_lens)], params, use_tqdm=False)
    finally:
        set_threads(old)
        for h in handles:
            h.remove()
    lps = []
    for o, s, p in zip(outs, sequences, prompt_lens):
        out = o.outputs[0]
        if list(out.token_ids) != list(s[p:]):
            raise RuntimeError("vime diagnose: vLLM did not follow the forced tokens")
        lps.append(torch.tensor([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)], dtype=torch.float32))
    return sites, lps


def _hooks_vllm(model, sites: Sites) -> list:
    c = model.config
    hs = [model.model.embed_tokens.register_forward_hook(_hook(sites, "embed", with_input=False)),
          model.model.norm.register_forward_pre_hook(_head_pre(sites)),
          model.model.norm.register_forward_hook(_hook(sites, "final_norm"))]
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        hs.append(layer.register_forward_pre_hook(_layer_pre(sites, i)))
        hs.append(layer.register_forward_hook(_hook(sites, "layer_output", with_input=False)))
        for name, mod in (("input_layernorm", layer.input_layernorm), ("q_proj", a.q_proj), ("k_proj", a.k_proj), ("v_proj", a.v_proj),
                          ("o_proj", a.o_proj), ("post_attention_layernorm", layer.post_attention_layernorm),
                          ("gate_proj", m.gate_proj), ("up_proj", m.up_proj), ("down_proj", m.down_proj)):
            hs.append(mod.register_forward_hook(_hook(sites, name)))
        for fused in (getattr(a, "qkv_fused", None), getattr(m, "gate_up_fused", None)):  # the engine's one-GEMM groups
            if fused is not None:  # (the separate linears' hooks above fire when a call runs them apart)
                hs.append(fused.register_forward_hook(_hook(sites, "fused", fused.split)))
        if c.qk_norm:
            hs += [a.q_norm.register_forward_hook(_hook(sites, "q_norm")), a.k_norm.register_forward_hook(_hook(sites, "k_norm"))]
        hs.append(model.attn[i].register_forward_hook(_attn_hook(sites)))
    return hs


def _attn_hook(sites: Sites):
    def fn(module, args, out):
        n = sum(len(p) for _, p in sites.rows)
        sites.put(sites.site("attention"), "in", torch.cat([t[:n].reshape(n, -1) for t in args[:3]], 1))
        sites.put(sites.site("attention"), "out", out[:n])
    return fn


# ---------------------------------------------------------------------------------------------- Megatron
def capture_megatron(trainer, sequences: list[list[int]], prompt_lens: list[int], temperature: float, threads: int) -> tuple[Sites, list]:
    """The trainer's packed scoring forward with hooks on every op; returns (sites, per-sequence logprobs)."""
    from .batch import TrainBatch

    _ready()
    model = trainer.model
    sites = Sites([len(s) for s in sequences])
    sites.sbh = True
    sites.rows = [(j, torch.arange(len(s))) for j, s in enumerate(sequences)]
    scored = [(j, torch.arange(p - 1, len(s) - 1)) for j, (s, p) in enumerate(zip(sequences, prompt_lens))]

    def on_logprob(tensors, out):
        start = 0
        for j, pos in scored:
            sites.put_rows("logprob", "out", j, pos, out[start:start + len(pos)].reshape(-1, 1))
            sites.put_rows("logprob", "in", j, pos, tensors[0][start:start + len(pos)])
            start += len(pos)

    sites.on_logprob = on_logprob
    handles = _hooks_megatron(model, sites)
    batch = TrainBatch(sequences=sequences, prompt_lens=prompt_lens, loss_mask=[torch.ones(len(s) - p) for s, p in zip(sequences, prompt_lens)],
                       temperature=temperature, weight_version=trainer.weight_version)
    set_threads, old = torch._C.set_num_threads, torch.get_num_threads()
    set_threads(threads)
    try:
        with rk.dispatch.tap(_tap(sites, ("rope", "swiglu", "attention", "linear_logprob"))):
            lps = trainer.score(batch)
    finally:
        set_threads(old)
        for h in handles:
            h.remove()
    return sites, [lp.float() for lp in lps]


def _hooks_megatron(model, sites: Sites) -> list:
    d = model.spec_config.decoder
    hpg, D, ng, inter = d.num_heads // d.num_kv_heads, d.head_dim, d.num_kv_heads, d.intermediate_size

    def qkv(y):  # Megatron's per-group [q heads; k; v] columns -> HF q, k, v
        g = y.reshape(y.shape[0], ng, (hpg + 2) * D)
        return {"q_proj": g[:, :, : hpg * D].reshape(y.shape[0], -1), "k_proj": g[:, :, hpg * D:(hpg + 1) * D].reshape(y.shape[0], -1),
                "v_proj": g[:, :, (hpg + 1) * D:].reshape(y.shape[0], -1)}

    def fc1(y):
        return {"gate_proj": y[:, :inter], "up_proj": y[:, inter:]}

    gpt = model.gpt
    hs = [gpt.embedding.register_forward_hook(_hook(sites, "embed", with_input=False)),
          model.final_layernorm.register_forward_pre_hook(_head_pre(sites)),
          model.final_layernorm.register_forward_hook(_hook(sites, "final_norm"))]
    for i, layer in enumerate(gpt.decoder.layers):
        a, m = layer.self_attention, layer.mlp
        hs.append(layer.register_forward_pre_hook(_layer_pre(sites, i)))
        hs.append(layer.register_forward_hook(_hook(sites, "layer_output", with_input=False)))
        for name, mod, split in (("input_layernorm", layer.input_layernorm, None), ("qkv", a.linear_qkv, qkv), ("o_proj", a.linear_proj, None),
                                 ("post_attention_layernorm", layer.pre_mlp_layernorm, None), ("fc1", m.linear_fc1, fc1),
                                 ("down_proj", m.linear_fc2, None)):
            hs.append(mod.register_forward_hook(_hook(sites, name, split)))
        if d.qk_norm:
            hs += [a.q_layernorm.register_forward_hook(_hook(sites, "q_norm")), a.k_layernorm.register_forward_hook(_hook(sites, "k_norm"))]
    return hs

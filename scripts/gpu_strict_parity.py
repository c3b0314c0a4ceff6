#!/usr/bin/env python3
"""The GPU strict path at Qwen3-8B dimensions: rollout == training bit for bit, and what it costs.

    python scripts/gpu_strict_parity.py [--layers 4] [--seqs 512] [--concurrency 256] [--out DIR]
                                        [--only kernels,parity,native,timing,train,sweep,reduce]

One process, one H200, random weights (no hub here), the rlkernel model definition
(rlkernel.models.decoder.StrictDecoder) with the dispatch choosing the "triton"
implementation under the GPU contracts (rlkernel/contracts/gpu.py):

  kernels  GEMM bits vs tile config / TMA; full log-softmax == fused kernel; backward
           correctness (linear, logprob, attention) against torch autograd, run-to-run bits
  parity   rollout-style: prompts prefilled into a paged KV cache, then batched decode with
           sequences joining and leaving (shifting batch composition, shuffled block tables)
           vs training-style: every sequence re-scored in one packed forward (other packings);
           mismatch_count over every generated token; run-to-run hash; golden hash per arch
  native   the same comparison with torch's production ops (negative control: mismatch > 0)
  timing   strict / native ratios in this process: GEMM vs cuBLAS, attention prefill vs SDPA,
           decode step (64 sequences), scoring forward
  train    forward + backward of the layer stack, strict / native
  sweep    candidate tile configs (not in the default list)
           (these three live in scripts/gpu_strict_timing.py and run in this process)
  reduce   the strict update's launch savers against their definitions, bit for bit (not in the default list)
  layouts  which piece of the engine layout (or which op) makes the rollout differ from packed scoring: the rollout
           in each layout, and every site's rows rollout vs packed (not in the default list)

Writes DIR/<card>_strict_parity.json (DIR: $OUT, else benchmarks/; <card>: the GPU's model from its name, h100 or
h200, else "gpu"; until session 51 every card wrote h200_). Without CUDA it writes gpu_strict_parity.json
{"skipped": reason} and exits 0.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gpu_shape_smoke import SHAPES  # noqa: E402  (scripts/ is this script's directory)

T0 = time.time()
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128,
                vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
# --dims: the harness at another model's width, the shape smoke's (scripts/gpu_shape_smoke.py); QWEN3_8B is updated in
# place (every section reads it), the architecture goes to ARCH
DIMS = {"qwen3_8b": {}, **SHAPES}
ARCH = {"arch": "qwen3"}
DEV = "cuda"  # scripts/ smoke tests may point this at "cpu" under TRITON_INTERPRET=1
# the keys (sequence * 65536 + position) of the token rows of the forward now running, one int64 tensor: engine_step and
# training_logprobs set it only while a SiteCapture is open (`layouts`); every captured row is keyed by it
ROW_KEYS: list = [None]
_CAPTURES = [0]  # open SiteCaptures


def _set_row_keys(pairs) -> None:
    """ROW_KEYS from (sequence, position) pairs (an iterable, read only while a capture is open)."""
    if _CAPTURES[0]:
        import torch
        ROW_KEYS[0] = torch.tensor([s * 65536 + p for s, p in pairs], device=DEV)
GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096),
         "lm_head": (4096, 151936)}


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def sha(t) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(-1).numpy().tobytes()).hexdigest()[:16]


# ---- model ---------------------------------------------------------------------------------

def build_model(layers: int, seed: int = 0, device=None, **dims):
    """The strict decoder at Qwen3-8B dimensions (`dims` overrides some: another model's shape), random bf16 weights,
    on `device` (default DEV)."""
    import torch
    from rlkernel.models.decoder import DecoderConfig, StrictDecoder
    dev = device or DEV
    cfg = DecoderConfig(arch=ARCH["arch"], num_layers=layers, tie_word_embeddings=False, **{**QWEN3_8B, **dims})
    with torch.device(dev):
        model = StrictDecoder(cfg, dtype=torch.bfloat16, device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, device=dev, generator=g))
            else:
                p.copy_(torch.randn(p.shape, device=dev, generator=g) * 0.02)
    model.requires_grad_(False)
    model.set_max_positions(8192)  # an engine's max_model_len: no position read-back in decode
    return model


class PagedCache:
    """A rollout engine's KV cache: fixed-size pages, a free list handed out in shuffled order."""

    def __init__(self, layers, num_blocks, block, hkv, d, seed=0):
        import torch
        self.k = [torch.zeros((num_blocks, block, hkv, d), dtype=torch.bfloat16, device=DEV) for _ in range(layers)]
        self.v = [torch.zeros_like(x) for x in self.k]
        self.block = block
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def ensure(self, sid, n_tokens):
        t = self.tables.setdefault(sid, [])
        while len(t) * self.block < n_tokens:
            t.append(self.free.pop())

    def release(self, sid):
        self.free.extend(self.tables.pop(sid))

    def slots(self, sid, positions):
        t = self.tables[sid]
        return [t[p // self.block] * self.block + p % self.block for p in positions]


def engine_step(model, cache, batch, tokens_of, pos_of, n_new):
    """One rollout step: for each (sid) in batch, feed n_new[sid] tokens at positions pos_of[sid]..;
    returns the hidden states of the last fed token of each request (in batch order)."""
    import torch
    import rlkernel as rk
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    for sid in batch:
        p0, n = pos_of[sid], n_new[sid]
        cache.ensure(sid, p0 + n)
        ids += tokens_of[sid][p0:p0 + n]
        pos += list(range(p0, p0 + n))
        slots += cache.slots(sid, range(p0, p0 + n))
        qsl.append(qsl[-1] + n)
        seq_lens.append(p0 + n)
    width = max(len(cache.tables[s]) for s in batch)
    bt = torch.tensor([cache.tables[s] + [0] * (width - len(cache.tables[s])) for s in batch], dtype=torch.int32,
                      device=DEV)
    ids_t = torch.tensor(ids, device=DEV)
    pos_t = torch.tensor(pos, device=DEV)
    slot_t = torch.tensor(slots, device=DEV)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=DEV)
    sl_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    max_q = max(n_new[s] for s in batch)
    _set_row_keys((sid, p) for sid in batch for p in range(pos_of[sid], pos_of[sid] + n_new[sid]))

    def attend(layer, q, k, v):
        rk.write_kv_cache(k, v, cache.k[layer], cache.v[layer], slot_t)
        return rk.attention_paged(q, cache.k[layer], cache.v[layer], bt, sl_t, qsl_t, max_query_len=max_q,
                                  max_seq_len=max(seq_lens))

    hidden = model.hidden_states(ids_t, pos_t, attend)
    return hidden[qsl_t[1:].long() - 1]


def rollout(model, seqs, prompt_lens, concurrency, cache, prefill_chunk=None, seed=0):
    """Rollout-style logprobs: lp[sid][t] = log p(seqs[sid][t] | < t) for t >= prompt_len, produced
    by prefill + one decode step per token, requests admitted as slots free up (shifting batches)."""
    import torch
    rng = random.Random(seed)
    order = list(range(len(seqs)))
    waiting = order[:]
    active: list[int] = []
    pos_of, out = {}, {s: [] for s in order}
    steps = 0
    while waiting or active:
        admit = []
        while waiting and len(active) + len(admit) < concurrency and (not admit or rng.random() < 0.5 or not active):
            admit.append(waiting.pop(0))
        n_new = {}
        for s in admit:  # prefill the prompt (all but nothing: the last prompt token is fed too)
            pos_of[s] = 0
            n_new[s] = prompt_lens[s]
        for s in active:
            n_new[s] = 1
        batch = active + admit
        rng.shuffle(batch)  # batch position changes step to step
        h = engine_step(model, cache, batch, seqs, pos_of, n_new)
        tgt = torch.tensor([seqs[s][pos_of[s] + n_new[s]] for s in batch], device=DEV)
        lp = model.logprobs(h, tgt)
        for i, s in enumerate(batch):
            out[s].append(lp[i:i + 1])
            pos_of[s] += n_new[s]
        active = [s for s in batch if pos_of[s] + 1 < len(seqs[s])]
        for s in batch:
            if s not in active:
                cache.release(s)
        steps += 1
    return {s: torch.cat(v) for s, v in out.items()}, steps


def training_logprobs(model, seqs, prompt_lens, pack_tokens, seed=1):
    """Training-style: sequences packed (shuffled, up to pack_tokens per forward), full forward,
    logprobs of every completion token."""
    import torch
    rng = random.Random(seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    out = {}
    i = 0
    while i < len(order):
        group, n = [], 0
        while i < len(order) and (not group or n + len(seqs[order[i]]) <= pack_tokens):
            group.append(order[i])
            n += len(seqs[order[i]])
            i += 1
        ids = torch.tensor([t for s in group for t in seqs[s]], device=DEV)
        lens = [len(seqs[s]) for s in group]
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
        _set_row_keys((s, p) for s in group for p in range(len(seqs[s])))
        hidden = model.forward_packed(ids, cu)
        rows, tg = [], []
        for j, s in enumerate(group):
            st = int(cu[j])
            for t in range(prompt_lens[s], len(seqs[s])):
                rows.append(st + t - 1)
                tg.append(seqs[s][t])
        lp = model.logprobs(hidden[torch.tensor(rows, device=DEV)], torch.tensor(tg, device=DEV))
        k = 0
        for s in group:
            n_c = len(seqs[s]) - prompt_lens[s]
            out[s] = lp[k:k + n_c]
            k += n_c
    return out


def make_seqs(n, vocab, prompt_range, gen_range, seed):
    rng = random.Random(seed)
    seqs, plens = [], []
    for _ in range(n):
        p, g = rng.randint(*prompt_range), rng.randint(*gen_range)
        seqs.append([rng.randrange(vocab) for _ in range(p + g)])
        plens.append(p)
    return seqs, plens


def compare(a: dict, b: dict):
    import torch
    tokens = mism = 0
    max_abs = 0.0
    for s in a:
        x, y = a[s], b[s]
        tokens += x.numel()
        bad = (x.view(torch.int32) != y.view(torch.int32))
        mism += int(bad.sum())
        if bad.any():
            max_abs = max(max_abs, float((x - y).abs().max()))
    return {"compared_tokens": tokens, "mismatch_count": mism, "max_abs_diff": max_abs}


def parity(args, res, model):
    import copy

    import torch
    import rlkernel as rk
    seqs, plens = make_seqs(args.seqs, QWEN3_8B["vocab_size"], (16, 256), (args.gen_min, args.gen_max), seed=7)
    # the rollout side in the engine's layout (vllm_model.py: fused projections, head norm + RoPE as one launch and the
    # residual adds in the norms), the training side in the trainer's (the model as built): the same weights
    engine = copy.deepcopy(model)
    engine.fuse_projections()
    res["parity_setup"] = {"sequences": len(seqs), "generated_tokens": sum(len(s) - p for s, p in zip(seqs, plens)),
                           "concurrency": args.concurrency, "layers": args.layers, "dtype": "bfloat16",
                           "page_size": 16, "prompt_tokens": [16, 256], "gen_tokens": [args.gen_min, args.gen_max],
                           "rollout_layout": "engine (StrictDecoder.fuse_projections)", "training_layout": "plain"}
    max_len = max(len(s) for s in seqs)
    blocks = args.concurrency * ((max_len + 15) // 16 + 1) + 64
    prov = rk.ProvenanceCounter()
    with torch.no_grad(), prov.collect():
        cache = PagedCache(args.layers, blocks, 16, QWEN3_8B["num_kv_heads"], QWEN3_8B["head_dim"], seed=3)
        t = time.time()
        ro, steps = rollout(engine, seqs, plens, args.concurrency, cache, seed=11)
        torch.cuda.synchronize()
        t_ro = time.time() - t
        log(f"rollout: {steps} engine steps in {t_ro:.1f}s")
        t = time.time()
        tr = training_logprobs(model, seqs, plens, pack_tokens=32768, seed=1)
        torch.cuda.synchronize()
        log(f"training-style scoring in {time.time() - t:.1f}s")
        tr2 = training_logprobs(model, seqs[: args.seqs // 4], plens, pack_tokens=8192, seed=5)
    res["provenance"] = prov.take()
    res["parity"] = compare(ro, tr)
    res["parity"]["engine_steps"] = steps
    res["parity"]["rollout_seconds"] = round(t_ro, 1)
    res["parity"]["other_packing"] = compare({s: tr[s] for s in tr2}, tr2)
    allv = torch.cat([ro[s] for s in sorted(ro)])
    res["parity"]["rollout_hash"] = sha(allv)
    res["parity"]["training_hash"] = sha(torch.cat([tr[s] for s in sorted(tr)]))
    log("parity:", res["parity"])
    # run to run: a second rollout of the first sequences, another admission order
    with torch.no_grad():
        sub = list(range(min(64, len(seqs))))
        cache = PagedCache(args.layers, blocks, 16, QWEN3_8B["num_kv_heads"], QWEN3_8B["head_dim"], seed=9)
        ro2, _ = rollout(engine, [seqs[i] for i in sub], [plens[i] for i in sub], 16, cache, seed=23)
    res["parity"]["rerun_other_batches"] = compare({i: ro[i] for i in sub}, ro2)
    log("rerun:", res["parity"]["rerun_other_batches"])


class SiteCapture:
    """Every token row a module's forward reads and writes, keyed by ROW_KEYS (sequence, position): forward hooks on
    `model`'s modules that `watch` picks. A hook on a norm or a layer makes the engine layout's residual and norm + RoPE
    fusions step aside there (decoder._hooked), so the engine layout's capture watches only modules whose hooks leave
    its fusions on (`ENGINE_SITES`)."""

    def __init__(self, model, watch):
        self.calls: dict[str, list] = {}
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules()
                        if name and watch(name, m)]
        _CAPTURES[0] += 1

    def _hook(self, name):
        def hook(mod, inp, out):
            import torch
            x = inp[0] if inp and isinstance(inp[0], torch.Tensor) else None
            y = out[0] if isinstance(out, tuple) else out
            keys = ROW_KEYS[0]
            if not isinstance(y, torch.Tensor) or keys is None or y.shape[0] != keys.shape[0]:
                return
            self.calls.setdefault(name, []).append(
                (keys, None if x is None or x.shape[0] != y.shape[0] else x.detach().reshape(len(keys), -1).clone(),
                 y.detach().reshape(len(keys), -1).clone()))
        return hook

    def close(self):
        for h in self.handles:
            h.remove()
        _CAPTURES[0] -= 1
        ROW_KEYS[0] = None

    def rows(self, name):
        """(keys sorted, inputs, outputs) of a site: the last row written for each key."""
        import torch
        calls = self.calls[name]
        keys = torch.cat([c[0] for c in calls])
        xs = None if any(c[1] is None for c in calls) else torch.cat([c[1] for c in calls])
        ys = torch.cat([c[2] for c in calls])
        order = torch.argsort(keys, stable=True)
        keys, ys = keys[order], ys[order]
        xs = xs[order] if xs is not None else None
        last = torch.ones_like(keys, dtype=torch.bool)
        last[:-1] = keys[1:] != keys[:-1]
        return keys[last], (xs[last] if xs is not None else None), ys[last]


def _bits(t):
    import torch
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def compare_sites(a: SiteCapture, b: SiteCapture) -> list[dict]:
    """Per site (in a's first-call order), over the rows both captured: rows whose input / output bits differ."""
    import torch
    out = []
    for name in a.calls:
        if name not in b.calls:
            continue
        ka, xa, ya = a.rows(name)
        kb, xb, yb = b.rows(name)
        ia = torch.isin(ka, kb)
        ib = torch.isin(kb, ka)
        ya, yb = ya[ia], yb[ib]
        row = {"site": name, "rows": int(ia.sum()), "out_differ": int((_bits(ya) != _bits(yb)).any(1).sum())}
        if xa is not None and xb is not None and xa.shape[1] == xb.shape[1]:
            row["in_differ"] = int((_bits(xa[ia]) != _bits(xb[ib])).any(1).sum())
        if row["out_differ"]:
            bad = (_bits(ya) != _bits(yb)).any(1)
            row["max_abs"] = float((ya[bad].float() - yb[bad].float()).abs().max())
            pos = (ka[ia][bad] % 65536)
            row["positions_differ"] = [int(pos.min()), int(pos.max())]
        out.append(row)
    return out


ENGINE_SITES = ("qkv_fused", "gate_up_fused", "o_proj", "down_proj", "embed_tokens")


def _layout(model, kind):
    """A copy of `model` in one of the engine layout's pieces: plain, engine (all of fuse_projections), qkv (fused q/k/v
    GEMM, and on qwen3 head norm + RoPE as one launch), gate_up (fused gate/up GEMM), residual (the residual adds inside
    the norms)."""
    import copy
    eng = copy.deepcopy(model)
    if kind == "engine":
        eng.fuse_projections()
    for layer in eng.model.layers:
        if kind == "qkv":
            layer.self_attn.fuse()
        elif kind == "gate_up":
            layer.mlp.fuse()
        elif kind == "residual":
            layer.fused_residual = True
    return eng


LAYOUTS = ("plain", "engine", "qkv", "gate_up", "residual")


def layouts(args, res, model):
    """Which piece of the rollout makes it differ from packed scoring: the rollout (paged decode, shifting batches) in
    each layout of `LAYOUTS` against packed scoring of the plain model, and against a rerun with other batches; then
    every site's rows, rollout vs packed scoring in the same layout (plain: every module; engine: `ENGINE_SITES`, whose
    hooks leave the fusions on), so the first site whose output differs on equal input names the op."""
    import torch
    seqs, plens = make_seqs(args.seqs, QWEN3_8B["vocab_size"], (16, 256), (args.gen_min, args.gen_max), seed=7)
    max_len = max(len(s) for s in seqs)
    blocks = args.concurrency * ((max_len + 15) // 16 + 1) + 64
    hkv, d = QWEN3_8B["num_kv_heads"], QWEN3_8B["head_dim"]
    sub = list(range(min(32, len(seqs))))
    out = {"sequences": len(seqs), "variants": {}, "sites": {}}
    with torch.no_grad():
        tr = training_logprobs(model, seqs, plens, pack_tokens=32768, seed=1)
        for kind in LAYOUTS:
            eng = _layout(model, kind)
            ro, steps = rollout(eng, seqs, plens, args.concurrency, PagedCache(args.layers, blocks, 16, hkv, d, seed=3),
                                seed=11)
            ro2, _ = rollout(eng, [seqs[i] for i in sub], [plens[i] for i in sub], 8,
                             PagedCache(args.layers, blocks, 16, hkv, d, seed=9), seed=23)
            out["variants"][kind] = {"vs_packed_plain": compare(ro, tr), "rerun_other_batches":
                                     compare({i: ro[i] for i in sub}, ro2)}
            if kind == "engine":
                out["variants"][kind]["packed_engine_vs_plain"] = compare(
                    training_logprobs(eng, seqs, plens, pack_tokens=32768, seed=1), tr)
            log(f"layout {kind}:", out["variants"][kind])
            del eng
        for kind, watch in (("plain", lambda n, m: not list(m.children()) or n.count(".") == 2),
                            ("engine", lambda n, m: n.rsplit(".", 1)[-1] in ENGINE_SITES)):
            eng = _layout(model, kind)
            cap_r = SiteCapture(eng, watch)
            rollout(eng, seqs[:64], plens[:64], min(args.concurrency, 32), PagedCache(args.layers, blocks, 16, hkv, d,
                                                                                        seed=3), seed=11)
            cap_r.close()
            cap_t = SiteCapture(eng, watch)
            training_logprobs(eng, seqs[:64], plens[:64], pack_tokens=32768, seed=1)
            cap_t.close()
            sites = compare_sites(cap_r, cap_t)
            first = next((r for r in sites if r["out_differ"] and not r.get("in_differ")), None)
            out["sites"][kind] = {"first_divergence": first, "sites": sites}
            log(f"sites {kind}: first divergence", first)
            del eng, cap_r, cap_t
            torch.cuda.empty_cache()
    res["layouts"] = out


def native_control(args, res, model):
    """The same comparison under torch's production ops (F.linear/cuBLAS, SDPA, log_softmax)."""
    import torch
    import rlkernel as rk
    seqs, plens = make_seqs(32, QWEN3_8B["vocab_size"], (16, 128), (128, 256), seed=8)
    max_len = max(len(s) for s in seqs)
    with torch.no_grad(), rk.mode("native"):
        cache = PagedCache(args.layers, 16 * ((max_len + 15) // 16 + 1) + 64, 16, QWEN3_8B["num_kv_heads"],
                           QWEN3_8B["head_dim"], seed=3)
        ro, steps = rollout(model, seqs, plens, 16, cache, seed=11)
        tr = training_logprobs(model, seqs, plens, pack_tokens=8192, seed=1)
    res["native"] = compare(ro, tr)
    log("native:", res["native"])


def kernels(res):
    import torch
    import torch.nn.functional as F
    from rlkernel.backends.triton import gemm, logprob
    from rlkernel.backends.triton import ops as O
    from rlkernel.contracts import gpu as G
    out = {}
    torch.manual_seed(0)
    a = torch.randn(2000, 4096, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device=DEV, dtype=torch.bfloat16) * 0.02
    base = gemm.matmul(a, w)
    variants = dict(G.BF16_GEMM)
    variants.update({"128x128x64": G.TileConfig(128, 128, 64, 3, 8), "64x128x128": G.TileConfig(64, 128, 128, 4, 4),
                     "64x64x32 no TMA": G.TileConfig(64, 64, 32, 3, 4, tma=False),
                     "64x128x128 no TMA": G.TileConfig(64, 128, 128, 3, 4, tma=False)})
    out["gemm_bits_vs_config"] = {k: bool(torch.equal(gemm.matmul(a, w, config=c), base)) for k, c in variants.items()}
    w2 = torch.randn(4096, 12288, device=DEV, dtype=torch.bfloat16) * 0.02  # down_proj, 4 canonical segments
    a2 = torch.randn(2000, 12288, device=DEV, dtype=torch.bfloat16)
    base2 = gemm.matmul(a2, w2, k_segments=4)
    out["gemm_segments_bits_vs_config"] = {
        f"{k}_{sc}": _recorded(lambda: bool(torch.equal(gemm.matmul(a2, w2, config=c, k_segments=4, schedule=sc), base2)))
        for k, c in variants.items() for sc in gemm.SCHEDULES}
    out["gemm_fp32_out_then_cast_equal"] = bool(torch.equal(gemm.matmul(a, w, out_dtype=torch.float32).bfloat16(), base))
    ms = (1, 7, 64, 65, 129, 1024, 1025)
    out["gemm_row_invariance_across_m_classes"] = all(bool(torch.equal(gemm.matmul(a[:m], w), base[:m])) for m in ms)
    out["gemm_segments_row_invariance"] = all(bool(torch.equal(gemm.matmul(a2[:m], w2, k_segments=4), base2[:m]))
                                              for m in ms)
    out["cublas_row_invariance"] = {m: bool(torch.equal(F.linear(a[:m], w), F.linear(a, w)[:m])) for m in ms}
    # fused logprob: the full table's entries equal the targets kernel's values
    h = torch.randn(64, 4096, device=DEV, dtype=torch.bfloat16)
    W = torch.randn(151936, 4096, device=DEV, dtype=torch.bfloat16) * 0.02
    tg = torch.randint(0, 151936, (64,), device=DEV)
    lp = O.linear_logprob("targets", h, W, tg, 1.0, 151936)
    full = O.linear_logprob("full", h, W, None, 1.0, 151936)
    out["logprob_full_equals_targets"] = bool(torch.equal(full.gather(1, tg[:, None])[:, 0], lp))
    ref = torch.log_softmax(F.linear(h.float(), W.float()), -1).gather(1, tg[:, None])[:, 0]
    out["logprob_max_abs_vs_fp32"] = float((lp - ref).abs().max())
    # backward correctness vs torch autograd (fp32 reference), and run-to-run bits
    x = torch.randn(512, 4096, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    wl = (torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16) * 0.02).requires_grad_()
    g = torch.randn(512, 4096, device=DEV, dtype=torch.bfloat16)
    gx, gw = torch.autograd.grad(O.linear(x, wl), (x, wl), g)
    gx2, gw2 = torch.autograd.grad(O.linear(x, wl), (x, wl), g)
    xr, wr = x.detach().float().requires_grad_(), wl.detach().float().requires_grad_()
    rx, rw = torch.autograd.grad(F.linear(xr, wr), (xr, wr), g.float())
    out["linear_bwd_rel_err"] = [float((gx.float() - rx).norm() / rx.norm()), float((gw.float() - rw).norm() / rw.norm())]
    out["linear_bwd_rerun_equal"] = bool(torch.equal(gx, gx2) and torch.equal(gw, gw2))
    hh = h[:32].clone().requires_grad_()
    Ws = W[:32768].clone().requires_grad_()
    t32 = tg[:32] % 32768
    gl = torch.randn(32, device=DEV)
    a1 = torch.autograd.grad(O.linear_logprob("targets", hh, Ws, t32, 0.9, 32768), (hh, Ws), gl)
    a2 = torch.autograd.grad(O.linear_logprob("targets", hh, Ws, t32, 0.9, 32768), (hh, Ws), gl)
    hr, Wr = hh.detach().float().requires_grad_(), Ws.detach().float().requires_grad_()
    r = torch.autograd.grad(torch.log_softmax(hr @ Wr.T / 0.9, -1).gather(1, t32[:, None])[:, 0], (hr, Wr), gl)
    out["logprob_bwd_rel_err"] = [float((a1[i].float() - r[i]).norm() / r[i].norm()) for i in range(2)]
    out["logprob_bwd_rerun_equal"] = bool(torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1]))
    try:
        out["attention_bwd"] = attention_bwd_check()
    except Exception as e:  # the backward kernel may be absent in an older tree
        out["attention_bwd"] = {"error": f"{type(e).__name__}: {e}"}
    res["kernels"] = out
    log("kernels:", json.dumps(out))


def attention_bwd_check():
    import torch
    import torch.nn.functional as F
    from rlkernel.backends.triton import ops as O
    torch.manual_seed(1)
    lens = [1000, 37, 2048]
    T = sum(lens)
    cu = torch.tensor([0, 1000, 1037, T], dtype=torch.int32, device=DEV)
    q = torch.randn(T, 32, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(T, 32, 128, device=DEV, dtype=torch.bfloat16)
    scale = 128 ** -0.5
    g1 = torch.autograd.grad(O.attention("varlen", q, k, v, cu, scale), (q, k, v), do)
    g2 = torch.autograd.grad(O.attention("varlen", q, k, v, cu, scale), (q, k, v), do)
    errs = []
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        qs, ks, vs = (t[lo:hi].detach().float().transpose(0, 1).requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(4, 0), vs.repeat_interleave(4, 0), is_causal=True,
                                           scale=scale)
        r = torch.autograd.grad(o, (qs, ks, vs), do[lo:hi].float().transpose(0, 1))
        errs.append([float((g1[j][lo:hi].float().transpose(0, 1) - r[j]).norm() / r[j].norm()) for j in range(3)])
    alone = torch.autograd.grad(O.attention("varlen", q[1000:1037], k[1000:1037], v[1000:1037],
                                            torch.tensor([0, 37], dtype=torch.int32, device=DEV), scale),
                                (q, k, v), do[1000:1037])
    same_alone = all(bool(torch.equal(alone[j][1000:1037], g1[j][1000:1037])) for j in range(3))
    return {"rel_err_per_seq_dq_dk_dv": errs, "rerun_equal": all(bool(torch.equal(a, b)) for a, b in zip(g1, g2)),
            "alone_equals_packed": same_alone}


def _recorded(fn):
    """fn()'s value, or its error as a string: a variant that fails to build (a new schedule) is recorded in the JSON and
    the other variants still run."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {str(e)[:200]}"


def bench(fn, ms=None):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=ms or 50)


def _timing():
    """scripts/gpu_strict_timing.py (the timing, train and sweep sections), which reads this module's settings."""
    import gpu_strict_timing

    return gpu_strict_timing


def reduce_checks(res):
    """`scripts/gpu_reduce_checks.py` (the strict update's launch savers, bit for bit, timed) with this script's device,
    timer and log."""
    from gpu_reduce_checks import run

    run(res, DEV, bench, log)


# issue 10's targets, read off this file's sections (`targets`: written with every run, so a merged file's figures
# and verdicts stay together). GEMM rows: M >= 256, the chained timer where the row has one (a CUDA graph of 8 calls:
# no host launch cost, which at M = 256 is a third of do_bench's time), else do_bench's
GEMM_TARGET, PREFILL_TARGET, DECODE_TARGET, SCORING_TARGET, TRAIN_TARGET, PARITY_TOKENS = 0.90, 0.85, 1.3, 1.15, 1.5, 1_000_000
ROW_PARALLEL = ("o", "down")
SEGMENTED = "segments4_warpspec_ratio"  # the library's schedule for a rank holding 4 canonical segments on sm_90


def targets(res: dict) -> dict:
    """Issue 10's targets from a harness result: each figure, the bound and whether it is met (None: not measured).

    The GEMM target is read at the default contract of the row-parallel layers (o, down): rlkernel.row_segments=auto
    gives each rank of the engine with the most TP ranks one canonical segment, a plain GEMM over its K slice (at
    TP=1 on both sides, the plain GEMM over K). A rank holding 4 segments (an engine with fewer ranks than the run's
    largest TP, or a run that pins rlkernel.row_segments=4 to compare bits across TP sizes) runs the segmented tile:
    its rows are reported beside, not counted in the target. The model-level rows (scoring, decode, train) run the
    rlkernel model at its library default of 4 segments, the slower form."""
    t = res.get("timing") or {}
    gemm_rows, segmented = {}, {}
    for key, row in (t.get("gemm") or {}).items():
        name, m = key.rsplit("_M", 1)
        if int(m) < 256:
            continue
        timer = "ratio_chain" if "ratio_chain" in row else "ratio_tflops"
        gemm_rows[key] = {"ratio": row[timer], "timer": timer}
        if name in ROW_PARALLEL and isinstance(row.get(SEGMENTED), (int, float)):
            segmented[key] = row[SEGMENTED]
    below = sorted(k for k, r in gemm_rows.items() if r["ratio"] < GEMM_TARGET)

    def ratio(section, key, bound, lower_is_better=False):
        v = (section or {}).get(key)
        if not isinstance(v, (int, float)):
            return {"value": None, "bound": bound, "met": None}
        return {"value": v, "bound": bound, "met": v <= bound if lower_is_better else v >= bound}

    par, nat = res.get("parity") or {}, res.get("native") or {}
    parity_met = None
    if par:
        parity_met = (par.get("compared_tokens", 0) >= PARITY_TOKENS and par.get("mismatch_count") == 0
                      and par.get("rollout_hash") == par.get("training_hash") and nat.get("mismatch_count", 0) > 0)
    return {
        "gemm_vs_cublas_m_ge_256": {
            "bound": GEMM_TARGET, "rows": gemm_rows, "min": min((r["ratio"] for r in gemm_rows.values()), default=None),
            "below": below, "met": (not below) if gemm_rows else None,
            "row_parallel_default": "rlkernel.row_segments=auto: one canonical segment a rank (plain GEMM over the rank's K)",
            "row_parallel_4_segments": {"rows": segmented, "min": min(segmented.values(), default=None),
                                        "note": "a rank holding 4 segments (fewer ranks than the run's largest TP, or "
                                                "rlkernel.row_segments=4 pinned): do_bench, not counted in the target"}},
        "attention_prefill_vs_sdpa": ratio(t.get("attention_prefill_8x4096"), "ratio", PREFILL_TARGET),
        "decode_step_b64_latency_cuda_graphs": ratio(t.get("decode_step_b64_ctx2048_cuda_graphs"), "ratio_latency", DECODE_TARGET, True),
        "decode_step_b64_latency_eager": ratio(t.get("decode_step_b64_ctx2048"), "ratio_latency", DECODE_TARGET, True),
        "scoring_forward_time": ratio(t.get("scoring_forward_8x2048"), "ratio_time", SCORING_TARGET, True),
        "forward_backward_time": ratio(res.get("train"), "ratio_time", TRAIN_TARGET, True),
        "parity": {"compared_tokens": par.get("compared_tokens"), "mismatch_count": par.get("mismatch_count"),
                   "hash": par.get("rollout_hash"), "native_mismatch_count": nat.get("mismatch_count"),
                   "bound": f">= {PARITY_TOKENS:,} tokens at 0, the native path > 0", "met": parity_met},
    }


def card_name(device_name: str) -> str:
    """The result file's prefix: the GPU's model in its name, lower case ("NVIDIA H100 80GB HBM3" -> h100,
    "NVIDIA H200" -> h200), else "gpu"."""
    m = re.search(r"\b([A-Z]{1,3}\d{2,4})[A-Z]?\b", device_name)
    return m.group(1).lower() if m else "gpu"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=544)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--gen-min", type=int, default=1024)
    ap.add_argument("--gen-max", type=int, default=3072)
    ap.add_argument("--only", default="kernels,parity,native,timing,train")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--merge", default=None, help="a previous call's JSON: keep its sections, add or replace these")
    ap.add_argument("--dims", choices=sorted(DIMS), default="qwen3_8b",
                    help="the model width (default Qwen3-8B's); another writes <card>_strict_parity_DIMS.json")
    args = ap.parse_args(argv)
    dims = dict(DIMS[args.dims])
    ARCH["arch"] = dims.pop("arch", "qwen3")
    QWEN3_8B.update(dims)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch
    card = card_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else "gpu"
    path = out_dir / (f"{card}_strict_parity.json" if args.dims == "qwen3_8b" else
                      f"{card}_strict_parity_{args.dims}.json")
    if not torch.cuda.is_available():
        path.write_text(json.dumps({"skipped": "no CUDA device"}, indent=1))
        print("skipped: no CUDA device")
        return 0
    import triton
    import rlkernel as rk
    from rlkernel.backends.triton import gemm_gluon
    res = json.loads(Path(args.merge).read_text()) if args.merge else {}
    res.pop("skipped", None)
    res.update({"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "torch": torch.__version__, "triton": triton.__version__, "args": vars(args),
           "contracts": {op: rk.contract_for(op, device=DEV).contract_id for op in rk.OPS}})
    log(res["contracts"])
    todo = args.only.split(",")
    model = build_model(args.layers) if set(todo) - {"kernels", "sweep", "reduce"} else None
    steps = {"kernels": lambda: kernels(res), "parity": lambda: parity(args, res, model),
             "native": lambda: native_control(args, res, model), "timing": lambda: _timing().timing(args, res, model),
             "train": lambda: _timing().train_timing(args, res, model), "sweep": lambda: _timing().sweep(args, res),
             "reduce": lambda: reduce_checks(res), "layouts": lambda: layouts(args, res, model)}
    for name in todo:
        try:
            steps[name]()
        except Exception as e:
            res.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            log(f"{name} FAILED: {type(e).__name__}: {e}")
        res["elapsed_s"] = round(time.time() - T0, 1)
        res["gemm_gluon"] = gemm_gluon.describe()  # the Gluon GEMM tiles this run could take, their first-use checks
        res["targets"] = targets(res)
        path.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res.get(k) for k in ("parity", "native", "errors")}, indent=1))
    print(json.dumps({k: v if k != "gemm_vs_cublas_m_ge_256" else {kk: vv for kk, vv in v.items() if kk != "rows"}
                      for k, v in res["targets"].items()}, indent=1))
    if "layouts" in res:
        print(json.dumps({k: v for k, v in res["layouts"].items() if k != "sites"}, indent=1))
        for kind, v in res["layouts"]["sites"].items():
            print(kind, "first divergence:", json.dumps(v["first_divergence"]))
    return 0


if __name__ == "__main__":
    # gpu_strict_timing imports this module by name: let it find this run (its --dims and settings), not a fresh copy
    sys.modules.setdefault("gpu_strict_parity", sys.modules[__name__])
    sys.exit(main())

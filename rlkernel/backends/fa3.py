"""Attention by FlashAttention 3 (vLLM's build) with one KV split: implementation "fa3" of the
FA3_ATTENTION contract (rlkernel/contracts/gpu.py). Opt-in, for both engines at once:
`rlkernel.ops.attention=fa3` (a recipe override) or `rlkernel.mode(ops={"attention": "fa3"})`.

What this module decides: when FA3 may decide the bits of a strict run, and how the trainer
differentiates it. FA3's order is its build's, not rlkernel's, so the engineering rule (a vendor
kernel decides bits only if checked at load) is kept by a probe that runs the first time the
implementation is asked for: on fixed inputs built from integers, a packed causal prefill, every
sequence alone, decode rows from a paged cache with shuffled pages (one batch, and one row at a
time with a max_seqlen_k far above the real lengths, as a captured CUDA graph runs) and chunked
prefill must all give the same rows bit for bit, and the packed output's hash must equal the
golden bits committed for this arch and vLLM version (`fa3_golden.json`, written on a GPU by
`python -m rlkernel.backends.fa3 --record`). Anything else — another vLLM, another chip, no golden
recorded, a property broken — leaves "fa3" unavailable with the reason in `unavailable_reason()`,
and a run that pinned it stops (dispatch never falls back).

The backward (training): FA3 in vLLM's build has none; rlkernel's Triton recompute kernels take
FA3's output and log-sum-exp (deterministic, no atomics; measured relative error 1e-3 against the
Triton forward's own gradients on an H200). Forward rows are what rollout and trainer compare.
bf16/fp16 only (FA3 has no fp32 kernel): an fp32 call raises.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path

import torch

from .. import dispatch
from ..contracts import gpu as G

GOLDEN = Path(__file__).resolve().parents[1] / "contracts" / "fa3_golden.json"
PROBE_LENS = (1, 16, 17, 200, 513)  # a single token, a page, a page + 1, a few pages, past 512
PROBE_HEADS, PROBE_KV_HEADS, PROBE_DIM, PROBE_BLOCK = 4, 2, 128, 16


def _vllm_version() -> str | None:
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means: no FA3 here
        return None
    return getattr(vllm, "__version__", None)


@functools.cache
def _fa3():
    from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported

    if not is_fa_version_supported(3):
        raise RuntimeError("vLLM's flash-attn build has no FA3 kernel for this GPU")
    return flash_attn_varlen_func


def _key() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}|vllm {_vllm_version()}"


def run(q, k, v, cu_q, max_q, scale, *, cu_k=None, seqused_k=None, max_k=None, table=None, lse=False, num_splits=1):
    """Causal FA3 (vLLM's build): packed (cu_k) or against a paged cache (seqused_k, table); the contract's one KV split
    unless num_splits says otherwise (the comparison script also times FA3's default)."""
    return _fa3()(q, k, v, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k or max_q, cu_seqlens_k=cu_k,
                  seqused_k=seqused_k, block_table=table, softmax_scale=scale, causal=True, num_splits=num_splits,
                  fa_version=3, return_softmax_lse=lse)


def paged_cache(k, v, cu, block: int, order, layout: str = "rlkernel_view"):
    """(k_cache, v_cache, block_table) holding every packed sequence's K/V, its pages taken from `order` (a permutation
    of pages 1.., page 0 left unused as vLLM's null block). layout "rlkernel_view": [blocks, kv_heads, 2 * block, D]
    read as strided K and V views (rlkernel's vLLM backend); "contiguous": [blocks, block, kv_heads, D] each (vLLM's)."""
    lens = (cu[1:] - cu[:-1]).tolist()
    need = [-(-n // block) for n in lens]
    nb, (hkv, d) = sum(need) + 1, k.shape[1:]
    table = torch.zeros((len(lens), max(need)), dtype=torch.int32)
    i = 0
    for s, m in enumerate(need):
        table[s, :m] = torch.tensor(list(order[i:i + m]), dtype=torch.int32)
        i += m
    table = table.to(k.device)
    if layout == "contiguous":
        kc = torch.zeros((nb, block, hkv, d), dtype=k.dtype, device=k.device)
        vc = torch.zeros_like(kc)
    else:
        raw = torch.zeros((nb, hkv, 2 * block, d), dtype=k.dtype, device=k.device)
        kc, vc = (x.transpose(1, 2) for x in raw.chunk(2, dim=2))
    for s, n in enumerate(lens):
        pos = torch.arange(n, device=k.device)
        a = int(cu[s])
        kc[table[s, pos // block].long(), pos % block] = k[a:a + n]
        vc[table[s, pos // block].long(), pos % block] = v[a:a + n]
    return kc, vc, table


def probe() -> tuple[str, dict]:
    """(hash of the packed prefill's bits, {property: rows that differ}) on the fixed probe; needs CUDA and FA3."""
    from ..golden import ints

    dev, lens = torch.device("cuda"), PROBE_LENS
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    T, hq, hkv, d, blk = int(cu[-1]), PROBE_HEADS, PROBE_KV_HEADS, PROBE_DIM, PROBE_BLOCK
    q, k, v = (ints(T, h, d, seed=s, scale=1 / 256).to(dev, torch.bfloat16) for s, h in ((1, hq), (2, hkv), (3, hkv)))
    scale = d ** -0.5
    packed = run(q, k, v, cu, max(lens), scale, cu_k=cu)
    bad = {"alone": 0, "decode_batch": 0, "decode_one_long_max": 0, "chunked_prefill": 0}
    for s, n in enumerate(lens):
        a = int(cu[s])
        one = torch.tensor([0, n], dtype=torch.int32, device=dev)
        bad["alone"] += int((run(q[a:a + n], k[a:a + n], v[a:a + n], one, n, scale, cu_k=one) != packed[a:a + n]).any(dim=(1, 2)).sum())
    # a paged cache in the layout rlkernel's vLLM backend reads, pages in a fixed shuffled order
    pages = sum(-(-n // blk) for n in lens)
    order = [(i * 7 + 3) % pages + 1 for i in range(pages)]  # a permutation of 1..pages when 7 and pages are coprime
    if len(set(order)) != pages:
        order = list(range(pages, 0, -1))
    kc, vc, table = paged_cache(k, v, cu, blk, order)
    last = (cu[1:] - 1).long()
    seq_lens = (cu[1:] - cu[:-1]).to(torch.int32)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=dev)
    dec = run(q[last], kc, vc, qsl, 1, scale, seqused_k=seq_lens, max_k=max(lens), table=table)
    bad["decode_batch"] = int((dec != packed[last]).any(dim=(1, 2)).sum())
    one_q = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    for s in range(len(lens)):
        o = run(q[last[s:s + 1]], kc, vc, one_q, 1, scale, seqused_k=seq_lens[s:s + 1], max_k=4096, table=table[s:s + 1])
        bad["decode_one_long_max"] += int((o != packed[last[s:s + 1]]).any(dim=(1, 2)).sum())
    for s, n in enumerate(lens):
        for a in range(0, n, 64):
            b = min(n, a + 64)
            o = run(q[int(cu[s]) + a:int(cu[s]) + b], kc, vc, torch.tensor([0, b - a], dtype=torch.int32, device=dev), b - a, scale,
                     seqused_k=torch.tensor([b], dtype=torch.int32, device=dev), max_k=b, table=table[s:s + 1])
            bad["chunked_prefill"] += int((o != packed[int(cu[s]) + a:int(cu[s]) + b]).any(dim=(1, 2)).sum())
    digest = hashlib.sha256(packed.float().cpu().numpy().tobytes()).hexdigest()[:24]
    return digest, bad


def _check() -> str | None:
    """Why "fa3" cannot decide bits here (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    version = _vllm_version()
    if version is None:
        return "vLLM is not installed (FA3 is vLLM's vllm_flash_attn build)"
    if version != G.FA3_VLLM:
        return f"the FA3 contract is pinned to vLLM {G.FA3_VLLM}; this environment has {version}"
    major, minor = torch.cuda.get_device_capability()
    if f"sm_{major}{minor}" != G.ARCH:
        return f"the FA3 contract is proved on {G.ARCH}; this GPU is sm_{major}{minor}"
    try:
        digest, bad = probe()
    except Exception as e:  # noqa: BLE001 - the reason is the message
        return f"the FA3 probe failed: {type(e).__name__}: {e}"
    if any(bad.values()):
        return f"FA3 broke a bit property on the probe (rows that differ: {bad})"
    golden = json.loads(GOLDEN.read_text()).get(_key()) if GOLDEN.exists() else None
    if golden is None:
        return (f"no golden bits are committed for {_key()} in {GOLDEN.name}: record them on this GPU with "
                "`python -m rlkernel.backends.fa3 --record` (after the probe's properties hold) and commit the file")
    if digest != golden:
        return f"FA3's bits on the probe ({digest}) differ from the committed golden ({golden}) for {_key()}"
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """None when "fa3" may run here, else why not (computed once per process: the probe runs at first use)."""
    return _check()


def available() -> bool:
    return unavailable_reason() is None


def _need_half(*ts):
    for t in ts:
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise dispatch.BackendUnavailable(f"rlkernel fa3: FA3 has no {t.dtype} kernel (bf16/fp16 only); use the triton "
                                              "implementation (rlkernel.ops.attention=strict) for this dtype")


def attention(kind, *args, max_query_len=None, max_seq_len=None):
    """The op's two forms with FA3, num_splits=1 (see the module docstring)."""
    if kind == "varlen":
        q, k, v, cu, scale = args
        _need_half(q, k, v)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        cu = cu.to(torch.int32)
        max_len = max_query_len if max_query_len is not None else int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            from .triton.ops import VarlenFn

            def fwd(q, k, v, cu, scale):  # FA3's out and lse, the lse as [T, Hq] float32 (the Triton backward's layout)
                out, lse = run(q, k, v, cu, max_len, scale, cu_k=cu, lse=True)
                return out, lse.transpose(0, 1).contiguous().float()

            return VarlenFn.apply(q, k, v, cu, scale, fwd, max_len)
        return run(q, k, v, cu, max_len, scale, cu_k=cu)
    q, kc, vc, bt, seq_lens, qsl, scale = args
    _need_half(q, kc, vc)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, kc, vc)):
        raise dispatch.BackendUnavailable("rlkernel fa3: paged attention is for inference; train with attention_varlen")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qsl = qsl.to(torch.int32)
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    return run(q, kc, vc, qsl, max_query_len, scale, seqused_k=seq_lens.to(torch.int32), max_k=max_seq_len,
                table=bt.to(torch.int32))


dispatch.register("attention", "fa3", G.FA3_ATTENTION, devices=("cuda",), available=available,
                  why=unavailable_reason)(attention)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Run the FA3 probe on this GPU; with --record, commit its golden bits.")
    ap.add_argument("--record", action="store_true", help=f"write the probe's hash to {GOLDEN.name} for this arch and vLLM")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or _vllm_version() is None:
        print(json.dumps({"skipped": "needs a CUDA device and vLLM"}))
        return 0
    digest, bad = probe()
    report = {"key": _key(), "digest": digest, "rows_differ": bad, "golden": (json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}).get(_key())}
    if args.record:
        if any(bad.values()):
            print(json.dumps(report | {"recorded": False, "why": "a bit property failed"}))
            return 1
        table = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        if table.get(_key()) not in (None, digest):
            print(json.dumps(report | {"recorded": False, "why": "a different golden is committed for this key: a new build? "
                                                                "bump FA3_ATTENTION's version first"}))
            return 1
        table[_key()] = digest
        GOLDEN.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        report["recorded"] = True
    report["unavailable_reason"] = _check()  # None: "fa3" may run here now
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

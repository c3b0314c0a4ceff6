"""Checks that need a live vLLM engine in their own process (vLLM in-process pins torch to
one thread and patches set_num_threads, which must not leak into the rest of the suite).
Run as `python tests/vllm_checks.py MODEL_DIR`; prints one JSON object."""
import json
import sys

if __name__ == "__main__":
    import torch

    from rlkernel.models import StrictDecoder
    from vime.records import SamplingSpec
    from vime.rollout import RolloutConfig, StaleWeightsError, VLLMRollout

    model = sys.argv[1]
    eng = VLLMRollout(RolloutConfig(model=model, mode="strict", max_num_seqs=4, max_num_batched_tokens=32, block_size=8))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (12,), generator=g)]
    spec = SamplingSpec(max_tokens=12)
    alone = [eng.generate([p], spec, greedy=True)[0] for p in prompts[:3]]
    batch = eng.generate(prompts, spec, greedy=True)
    same = all(a.response_ids == b.response_ids and a.logprobs.tobytes() == b.logprobs.tobytes() for a, b in zip(alone, batch))
    out = {"alone_equals_batched": same, "greedy_tokens": sum(len(a.response_ids) for a in alone)}
    try:
        eng.generate(prompts[:1], spec, weight_version=1)
        out["stale_detected"] = False
    except StaleWeightsError:
        out["stale_detected"] = True
    ref = StrictDecoder.from_pretrained(model)
    try:
        eng.update_weights(dict(ref.state_dict()), 0)
        out["non_increasing_version_rejected"] = False
    except ValueError:
        out["non_increasing_version_rejected"] = True
    eng.update_weights({k: v * 1.01 for k, v in ref.state_dict().items()}, 1)
    out["version_after_update"] = eng.weight_version
    out["worker_version"] = eng.llm.collective_rpc("rlkernel_weight_version")[0]
    out["stamped"] = all(c.weight_version == 1 for c in eng.generate(prompts[:2], spec, weight_version=1))
    try:
        eng.generate(prompts[:1], SamplingSpec(temperature=0.5, max_tokens=2))
        out["temperature_mismatch_rejected"] = False
    except ValueError:
        out["temperature_mismatch_rejected"] = True
    print(json.dumps(out))

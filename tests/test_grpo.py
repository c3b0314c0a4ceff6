"""Claims: the GRPO loss equals a plain float64 implementation of the formulas on random
inputs (advantages, both clip branches, each KL estimator, entropy bonus, TIS), each clip
branch is exercised, and its gradient is bitwise deterministic across thread counts."""
import math

import pytest
import torch

from helpers import threads
from vime.grpo import GRPOConfig, group_advantages, grpo_loss


def _reference(lp, old, adv, mask, eps_lo, eps_hi, kl_coef=0.0, est="k3", ref=None, ent_coef=0.0, ent=None, tis=None, roll=None):
    """Float64, per token, with Python math: the formulas as written in papers."""
    total, n = 0.0, 0
    for i in range(len(lp)):
        if not mask[i]:
            continue
        r = math.exp(lp[i] - old[i])
        term = max(-adv[i] * r, -adv[i] * min(max(r, 1 - eps_lo), 1 + eps_hi))
        if tis is not None:
            term *= min(math.exp(old[i] - roll[i]), tis)
        if kl_coef:
            lr = ref[i] - lp[i]
            k = {"k1": -lr, "k3": math.exp(lr) - lr - 1, "low_var_kl": min(max(math.exp(lr) - lr - 1, -10), 10)}[est]
            term += kl_coef * k
        if ent_coef:
            term -= ent_coef * ent[i]
        total += term
        n += 1
    return total / max(n, 1)


@pytest.mark.parametrize("est", ["k1", "k3", "low_var_kl"])
@pytest.mark.parametrize("tis", [None, 2.0])
def test_loss_matches_float64_reference(est, tis):
    g = torch.Generator().manual_seed(0)
    T = 400
    lp = -torch.rand(T, generator=g) * 3
    old = lp + torch.randn(T, generator=g) * 0.3  # ratios well outside [0.8, 1.28]: both branches bind
    ref = lp + torch.randn(T, generator=g) * 0.5
    roll = old + torch.randn(T, generator=g) * 0.2
    adv = torch.randn(T, generator=g)
    ent = torch.rand(T, generator=g)
    mask = (torch.rand(T, generator=g) > 0.2).float()
    cfg = GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, kl_estimator=est, entropy_coef=0.01, tis_cap=tis)
    loss, m = grpo_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, rollout_logprobs=roll, entropy=ent)
    expect = _reference(*(t.double().tolist() for t in (lp, old, adv, mask)), 0.2, 0.28, 0.05, est, ref.double().tolist(), 0.01,
                        ent.double().tolist(), tis, roll.double().tolist())
    assert abs(loss.item() - expect) < 1e-5 * max(1.0, abs(expect))
    r = torch.exp(lp - old)
    assert ((r < 0.8) & (mask > 0) & (adv < 0)).any() and ((r > 1.28) & (mask > 0) & (adv > 0)).any()
    assert 0 < m["clip_fraction"] < 1


def test_advantages_match_reference():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, 0.0, 1.0, 3.0]])
    adv = group_advantages(rewards, GRPOConfig())
    for gi, row in enumerate(rewards.tolist()):
        mu = sum(row) / len(row)
        sd = math.sqrt(sum((x - mu) ** 2 for x in row) / len(row))
        for j, x in enumerate(row):
            assert abs(adv[gi, j].item() - (x - mu) / (sd + 1e-6)) < 1e-5
    assert torch.equal(adv[1], torch.zeros(4))  # a group with one reward carries no signal
    raw = group_advantages(rewards, GRPOConfig(normalize_adv_std=False))
    assert torch.equal(raw[2], torch.tensor([0.5, -1.5, -0.5, 1.5]))  # exact: these are representable


def test_gradient_is_deterministic_across_threads():
    g = torch.Generator().manual_seed(1)
    T = 50_000
    base = -torch.rand(T, generator=g) * 3
    old, adv, mask = base + torch.randn(T, generator=g) * 0.1, torch.randn(T, generator=g), (torch.rand(T, generator=g) > 0.1).float()

    def run():
        lp = base.clone().requires_grad_(True)
        loss, _ = grpo_loss(lp, old, adv, mask, GRPOConfig())
        loss.backward()
        return loss.detach(), lp.grad

    with threads(1):
        a = run()
    with threads(2):
        b = run()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bad_config_and_missing_inputs():
    with pytest.raises(ValueError):
        GRPOConfig(kl_estimator="k2")
    with pytest.raises(ValueError):
        GRPOConfig(tis_cap=0)
    x = torch.zeros(3)
    with pytest.raises(ValueError):
        grpo_loss(x, x, x, torch.ones(3), GRPOConfig(kl_coef=0.1))
    with pytest.raises(ValueError):
        grpo_loss(x, x, x, torch.ones(3), GRPOConfig(tis_cap=2.0))


def test_metrics_read_after_the_step_are_the_same_floats():
    """grpo_loss(read_back=False) keeps its metrics on the device (the trainer reads them after its optimizer step, in
    one read): read_metrics gives exactly the floats read_back=True gives, the loss the same bits; with no token in the
    mask ratio_max is 1.0 either way."""
    from vime.grpo import read_metrics

    g = torch.Generator().manual_seed(5)
    T = 40
    lp, old, adv = torch.randn(T, generator=g) - 2, torch.randn(T, generator=g) - 2, torch.randn(T, generator=g)
    ent, ref, roll = torch.rand(T, generator=g), torch.randn(T, generator=g) - 2, torch.randn(T, generator=g) - 2
    cfg = GRPOConfig(kl_coef=0.05, entropy_coef=0.01, tis_cap=2.0)
    for mask in ((torch.rand(T, generator=g) > 0.3).float(), torch.zeros(T)):
        eager_loss, eager = grpo_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, rollout_logprobs=roll, entropy=ent)
        lazy_loss, lazy = grpo_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, rollout_logprobs=roll, entropy=ent, read_back=False)
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in lazy.values()), lazy
        assert all(isinstance(v, float) for v in eager.values()) and read_metrics(lazy) == eager
        assert torch.equal(lazy_loss, eager_loss)
    assert eager["ratio_max"] == 1.0  # the empty mask

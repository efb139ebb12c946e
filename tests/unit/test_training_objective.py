"""The decoupled PPO objective, the temperature, and the loss diagnostics (trainer.py)."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.errors import InvalidArgument
from services.cell_agent.training.microstep import Sequence
from services.cell_agent.training.trainer import LAG_BUCKETS, LossConfig, LossStats, token_losses

V = 7


def _case(seed: int = 0) -> tuple[torch.Tensor, tuple[int, ...], list[float]]:
    torch.manual_seed(seed)
    logits = torch.randn(1, 5, V, dtype=torch.float64, requires_grad=True)
    ids = (1, 2, 3, 4, 5)
    logp = torch.log_softmax(logits[0].detach(), -1)
    true = [float(logp[j - 1, ids[j]]) for j in range(1, 5)]
    return logits, ids, true


def test_decoupled_weights_each_token_by_prox_over_behaviour_and_masks_above_the_cap():
    logits, ids, true = _case()
    # Behaviour log-probs: token 1 sampled by a policy that found it likelier (w < 1), token 2
    # by one that found it much less likely (w = e^2 > cap 5: masked), token 3 as now (w = 1).
    behav = (0.0, min(true[0] + 0.5, 0.0), true[1] - 2.0, true[2], 0.0)
    seq = Sequence(ids, (0, 1, 1, 1, 0), behav, advantage=1.5, policy_versions=(0, 3, 1, 4, 0))
    loss, n, stats = token_losses(logits, [seq], LossConfig(objective="decoupled"), version=4)
    w = [math.exp(true[0] - behav[1]), math.exp(true[1] - behav[2]), 1.0]
    assert w[1] > 5.0
    assert n == 3
    # r = π_θ / π_prox is 1 in value: the loss is -Σ w·A over the kept tokens.
    assert loss.item() == pytest.approx(-(w[0] + w[2]) * 1.5, rel=1e-12)
    # Its gradient is -Σ w·A·∇log π_θ of the kept tokens only.
    loss.backward()
    logits2 = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(logits2[0], -1)
    want = -(w[0] * 1.5 * logp[0, ids[1]] + w[2] * 1.5 * logp[2, ids[3]])
    want.backward()
    assert logits.grad is not None and logits2.grad is not None
    assert torch.allclose(logits.grad, logits2.grad, atol=1e-12)
    # Diagnostics.
    assert stats.tokens == 3 and stats.capped == 1
    assert stats.weight_max == pytest.approx(w[1])
    assert stats.weight_sum == pytest.approx(sum(w))
    assert stats.lag[:4] == [1.0, 1.0, 0.0, 1.0]  # lags 1, 3, 0
    assert stats.gap_tokens == 1 and stats.gap_sum == pytest.approx(0.0, abs=1e-12)
    assert stats.clipped == 0  # one step per batch: the proximal ratio is 1


def test_coupled_clips_against_the_behaviour_log_probs():
    logits, ids, true = _case(1)
    behav = (0.0, true[0] - 1.0, true[1], true[2], 0.0)  # token 1: ratio e^1, clipped for A > 0
    seq = Sequence(ids, (0, 1, 1, 1, 0), tuple(min(b, 0.0) for b in behav), advantage=1.0)
    loss, n, stats = token_losses(logits, [seq], LossConfig(objective="coupled"))
    assert n == 3 and stats.clipped == 1
    loss.backward()
    # The clipped token gets no gradient: only tokens 2 and 3 (ratio 1) move.
    logits2 = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(logits2[0], -1)
    (-(logp[1, ids[2]] + logp[2, ids[3]])).backward()
    assert logits.grad is not None and logits2.grad is not None
    assert torch.allclose(logits.grad, logits2.grad, atol=1e-12)


def test_log_probs_are_scored_at_the_sampling_temperature():
    logits, ids, _ = _case(2)
    t = 0.5
    logp_t = torch.log_softmax(logits[0].detach() / t, -1)
    behav = tuple([0.0] + [float(logp_t[j - 1, ids[j]]) for j in range(1, 5)])
    seq = Sequence(ids, (0, 1, 1, 1, 1), behav, advantage=1.0, temperature=t)
    _, _, stats = token_losses(logits, [seq], LossConfig())
    # At the engine's temperature, trainer and engine agree: every weight is 1, no gap.
    assert stats.weight_sum == pytest.approx(4.0)
    assert stats.gap_sum == pytest.approx(0.0, abs=1e-9)
    _, _, at_one = token_losses(logits, [Sequence(ids, (0, 1, 1, 1, 1), behav, 1.0)], LossConfig())
    assert at_one.gap_sum > 0.1  # scored at T = 1 they would not


def test_stats_add_and_travel_as_one_tensor():
    a = LossStats(tokens=4, clipped=1, weight_sum=4.4, weight_max=1.5, capped=0, entropy_sum=2.0)
    b = LossStats(tokens=2, clipped=0, weight_sum=1.6, weight_max=3.0, capped=1, entropy_sum=1.0)
    b.lag[2] = 2.0
    a.add(b)
    back = LossStats.from_tensors(a.sums_tensor(), a.weight_max)
    assert back == a
    s = back.summary()
    assert s["clip_fraction"] == pytest.approx(1 / 6)
    assert s["behaviour_weight_mean"] == pytest.approx(1.0)
    assert s["behaviour_weight_max"] == 3.0
    assert s["behaviour_weight_capped_share"] == pytest.approx(1 / 6)
    assert len(s["lag_hist"]) == LAG_BUCKETS and s["lag_mean"] == pytest.approx(4 / 6)


def test_bad_objective_settings_are_refused():
    with pytest.raises(InvalidArgument, match="objective"):
        LossConfig(objective="ppo")
    with pytest.raises(InvalidArgument, match="cap"):
        LossConfig(behaviour_weight_cap=1.0)
    with pytest.raises(InvalidArgument, match="temperature"):
        Sequence((1, 2), (0, 1), (0.0, -1.0), 1.0, temperature=float("nan"))
    with pytest.raises(InvalidArgument, match="policy_versions"):
        Sequence((1, 2), (0, 1), (0.0, -1.0), 1.0, policy_versions=(0,))

"""The local sampler and evaluator (apps/eval/local.py) and the bootstrap (apps/eval/stats.py):
an evaluation is deterministic for a seed and its interval brackets its mean; the sampler
serves calls the way the router does (prompts continue the execution's tokens, tool calls
parsed by the router's parser) and keeps what a learner needs (prompt ids, generated ids
and their log-probs at the sampling temperature, which the trainer-side scoring reproduces)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.eval.local import (
    Policy,
    evaluate,
    generate,
    group_advantages,
    policy_gradient_step,
    sample_rollouts,
    token_logprobs,
)
from apps.eval.stats import bootstrap_ci
from apps.harness.env import EnvConfig, eval_tasks

# Short episodes: a random model writes garbage up to max_tokens at every turn.
ENV = EnvConfig(time_scale=0.0, turns_min=2, turns_max=2, max_tokens=12, digit_credit=0.0)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    from apps.model.tiny import build_tiny_model

    return Policy.load(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


def test_bootstrap_ci_on_known_data():
    assert bootstrap_ci([0.5] * 10) == (0.5, 0.5, 0.5)
    assert bootstrap_ci([3.0]) == (3.0, 3.0, 3.0)
    values = [0.0, 1.0] * 50
    mean, lo, hi = bootstrap_ci(values, seed=1)
    assert mean == 0.5
    assert 0.38 < lo < 0.45 and 0.55 < hi < 0.62  # ~ 0.5 ± 1.96 · 0.05
    assert bootstrap_ci(values, seed=1) == (mean, lo, hi)  # deterministic for a seed
    narrow = bootstrap_ci(values, level=0.5, seed=1)
    assert lo < narrow[1] <= narrow[2] < hi
    skewed = bootstrap_ci([0.0] * 30 + [1.0], seed=3)
    assert skewed[1] <= skewed[0] <= skewed[2]
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_evaluate_is_deterministic_for_a_seed_and_its_interval_brackets_the_mean(policy: Policy):
    tasks = eval_tasks(6)
    a = evaluate(policy, tasks, ENV, samples_per_task=2, seed=3)
    b = evaluate(policy, tasks, ENV, samples_per_task=2, seed=3)
    assert a.n == 12 and len(a.per_task) == 6 and set(a.per_task) == {t.task_id for t in tasks}
    assert a.ci95[0] <= a.mean <= a.ci95[1]
    assert a.summary() | {"seconds": 0} == b.summary() | {"seconds": 0}
    tokens = [[t.output_ids for t in r.turns] for r in a.rollouts]
    assert tokens == [[t.output_ids for t in r.turns] for r in b.rollouts]
    c = evaluate(policy, tasks, ENV, samples_per_task=2, seed=4)
    assert tokens != [[t.output_ids for t in r.turns] for r in c.rollouts]


def test_the_sampler_serves_calls_like_the_router_and_keeps_what_a_learner_needs(policy: Policy):
    rollouts = sample_rollouts(policy, [(t, m) for t in eval_tasks(3) for m in range(2)], ENV, seed=0)
    stop = policy.tok.stop_token_ids
    for r in rollouts:
        assert len(r.turns) == r.result.turns == 2
        first, second = r.turns
        # the second call's prompt continues the first call's tokens exactly
        assert (
            second.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)]
            == first.prompt_ids + first.output_ids
        )
        for turn in r.turns:
            assert len(turn.output_ids) == len(turn.logprobs) <= ENV.max_tokens
            assert turn.finish_reason == ("stop" if turn.output_ids[-1] in stop else "length")
            assert all(lp <= 0.0 for lp in turn.logprobs)
            assert turn.message["role"] == "assistant"
        (segment,) = r.segments()
        assert segment.tokens == second.prompt_ids + second.output_ids
        assert sum(segment.mask) == len(first.output_ids) + len(second.output_ids)
    # the trainer-side scoring (one forward, shared prefix) reproduces the sampler's log-probs
    segments = [s for r in rollouts for s in r.segments()]
    scored = [lp.detach() for lp in token_logprobs(policy.model, segments, ENV.temperature)]
    for s, lp in zip(segments, scored, strict=True):
        sampled = [x for x, m in zip(s.logprobs, s.mask, strict=True) if m]
        assert len(lp) == len(sampled)
        assert max(abs(float(x) - y) for x, y in zip(lp, sampled, strict=True)) < 1e-3


def test_generate_greedy_is_deterministic_and_stops_at_im_end(policy: Policy):
    prompts = [[1, 5, 9, 11], [1, 5, 9, 12, 40, 41]]
    a = generate(policy.model, prompts, 6, 0.0, policy.tok.stop_token_ids)
    b = generate(policy.model, prompts[::-1], 6, 0.0, policy.tok.stop_token_ids)
    assert [g.token_ids for g in a] == [g.token_ids for g in b[::-1]]  # a row does not see the others
    forced = generate(policy.model, prompts, 6, 0.0, [a[0].token_ids[0]])
    assert forced[0].token_ids == a[0].token_ids[:1] and forced[0].finish_reason == "stop"


def test_a_policy_gradient_step_moves_only_on_mixed_groups(policy: Policy, tmp_path: Path):
    import copy

    import torch

    rollouts = sample_rollouts(policy, [(t, m) for t in eval_tasks(2) for m in range(2)], ENV, seed=1)
    assert group_advantages(rollouts) == [0.0] * 4  # a random model earns nothing: no signal
    rollouts[0].result.reward = 1.0
    adv = group_advantages(rollouts)
    assert adv[:2] == [0.5, -0.5] and adv[2:] == [0.0, 0.0]
    trained = Policy(copy.deepcopy(policy.model), policy.tok)
    opt = torch.optim.AdamW(trained.model.parameters(), lr=1e-3)
    stats = policy_gradient_step(trained, opt, rollouts)
    assert stats["trained"] == 2 and stats["episodes"] == 4
    (seg,) = rollouts[0].segments()
    before = token_logprobs(policy.model, [seg])[0].sum()
    after = token_logprobs(trained.model, [seg])[0].sum()
    assert float(after.detach()) > float(before.detach())  # the rewarded episode became more likely
    saved = trained.save(tmp_path / "saved")
    assert Policy.load(saved).model.config.vocab_size == policy.model.config.vocab_size

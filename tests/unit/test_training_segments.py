"""Training each trajectory segment once equals training each turn with its whole prompt:
on token-consistent multi-turn episodes packed by the real packer, the gradient sum and the
loss-token count of the per-segment sequences equal those of the per-turn sequences within
the equivalence test's tolerance (float64), for a fraction of the tokens; and the check is
sensitive (dropping one turn's loss mask changes the gradient)."""

from __future__ import annotations

import random

import torch

from services.cell_agent.training.microstep import MicroStep, Sequence
from services.cell_agent.training.trainer import LossConfig, Trainer
from testkit import packer_kit as tk
from testkit.training_fakes import TOL, tiny_lm


async def _packed():
    rng = random.Random(11)
    p, _, _ = tk.make_packer(batch_size=1, micro_step_token_budget=4096)
    eps = [tk.episode(f"g-x{k}", "g", 4 + k, rng, edit_at=3 if k == 2 else -1, version=0) for k in range(3)]
    for k, turns in enumerate(eps):
        for t in turns:
            await p.record_turn(t)
        await p.report_finish(tk.finish(f"g-x{k}", "g", 3, reward=float(k)))
    await p.reap()
    claim = await p.claim("c", 0, 0, 0)
    assert claim.micro_step is not None
    return claim.micro_step, [t for turns in eps for t in turns]


def _full_precision_norms(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' Qwen2RMSNorm computes in float32 even in a float64 model; the backward's
    float32 roundings then depend on how gradients were summed (one segment or several
    turns), ~1e-7 relative. Computed in the model's dtype, both layouts agree to float64
    rounding, so the comparison can use the equivalence test's tolerance."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):

            def forward(x: torch.Tensor, m: torch.nn.Module = module) -> torch.Tensor:
                return m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))

            module.forward = forward
    return model


def _grads(seqs: list[Sequence]) -> tuple[torch.Tensor, int]:
    # Wide clip range: the synthetic behaviour log-probs are far from the model's, and a
    # clipped ratio would silence most tokens' gradients.
    trainer = Trainer(_full_precision_norms(tiny_lm(seed=4)), version=0, loss=LossConfig(1.0, 100.0))
    n = trainer.accumulate(MicroStep("m", 1, tuple(seqs)), 0)
    return trainer.flat_grads().clone(), n


async def test_per_segment_gradient_equals_per_turn_gradient():
    ms, turns = await _packed()
    by_x = {s.segment.last.execution_id: s.advantage for s in ms.sequences}
    segments = [Sequence.from_proto(s.to_proto()) for s in ms.sequences]
    assert len(segments) == 4  # 3 episodes, one of them broken in two by a history edit
    per_turn = [
        Sequence(
            tuple(t.prompt) + tuple(t.output),
            (0,) * len(t.prompt) + tuple(t.mask),
            (0.0,) * len(t.prompt) + tuple(lp if m else 0.0 for lp, m in zip(t.logprobs, t.mask)),
            by_x[t.execution_id],
            t.execution_id,
        )
        for t in turns
    ]
    assert sum(len(s.token_ids) for s in segments) < sum(len(s.token_ids) for s in per_turn)
    g_seg, n_seg = _grads(segments)
    g_turn, n_turn = _grads(per_turn)
    assert n_seg == n_turn == sum(t.loss_tokens for t in turns)
    assert g_seg.abs().max() > 0
    assert torch.allclose(g_seg, g_turn, rtol=0, atol=TOL), (g_seg - g_turn).abs().max()
    # Sensitive: one turn's tokens left out of the loss changes it.
    one = per_turn[0]
    less = per_turn[1:] + [
        Sequence(one.token_ids, (0,) * len(one.token_ids), (0.0,) * len(one.token_ids), one.advantage)
    ]
    g_less, _ = _grads(less)
    assert not torch.allclose(g_seg, g_less, rtol=0, atol=TOL)

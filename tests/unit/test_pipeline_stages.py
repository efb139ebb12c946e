"""The stages of a pipelined cell, in one process: the layer split, and stage modules that
compose to the whole model (issue 34)."""

from __future__ import annotations

import pytest
import torch

from gyre.errors import InvalidArgument
from services.cell_agent.training.pipeline import StageModule, round_tensors, stage_bounds, unpack_targets
from services.cell_agent.training.trainer import LossConfig, TokenTargets, target_losses, token_losses
from testkit.pipeline_rig import micro_steps


def _model(layers: int = 2, tied: bool = False):  # a small Qwen2 causal LM, float64
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(cfg).double()


def test_pipeline_stage_bounds_split_the_layers_evenly():
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(2, 1) == [(0, 2)]
    with pytest.raises(InvalidArgument):
        stage_bounds(2, 3)
    with pytest.raises(InvalidArgument):
        stage_bounds(2, 0)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_pipeline_stages_compose_to_the_model(stages):
    model = _model(layers=4, tied=True).eval()
    ids = torch.randint(0, 64, (3, 11))
    want = model(input_ids=ids).logits
    mods = [StageModule(model, s, stages) for s in range(stages)]
    h = ids
    for m in mods:
        h = m(h)
    assert torch.allclose(h, want, atol=1e-10)
    names = [n for m in mods for n in m.names]
    every = [n for n, _ in model.named_parameters()]
    assert set(names) == set(every)
    # Tied embeddings: the first and the last stage hold the same weight.
    assert len(names) == len(every) + (1 if stages > 1 else 0)
    if stages > 1:
        assert mods[0].names[0] == mods[-1].names[-1] == "model.embed_tokens.weight"


def test_pipeline_round_targets_give_the_trainers_loss():
    """A round's padded target tensor gives the loss of the sequences themselves."""
    steps = micro_steps(3, vocab=50, seed=1)
    rows = max(len(s.sequences) for s in steps)
    width = max(len(q.token_ids) for s in steps for q in s.sequences)
    ids, target = round_tensors(steps, 5, rows, width)
    assert ids.shape == (3 * rows, width) and target.shape == (3 * rows, width, 6)
    torch.manual_seed(0)
    logits = torch.randn(3 * rows, width, 50, dtype=torch.float64)
    cfg = LossConfig()
    loss, n, _ = target_losses(logits, unpack_targets(target, torch.float64), cfg)
    want_loss, want_n = torch.zeros((), dtype=torch.float64), 0
    for k, step in enumerate(steps):
        seqs = list(step.sequences)
        part = logits[k * rows : k * rows + len(seqs)]
        part_loss, m, _ = token_losses(part, seqs, cfg, version=5)
        want_loss, want_n = want_loss + part_loss, want_n + m
    assert n == want_n
    assert torch.allclose(loss, want_loss, atol=1e-12)
    assert isinstance(TokenTargets.of(list(steps[0].sequences)), TokenTargets)


def test_pipeline_a_round_on_another_version_is_refused_before_it_is_announced():
    """A round on another weight version than the batch's is refused by the leader before
    the other stages hear of it (they would run a round the leader does not)."""
    from services.cell_agent.training.pipeline import PipelineCell

    cell = PipelineCell(StageModule(_model(), 0, 1), ranks=[0], group=None)
    steps = micro_steps(2, vocab=64, seed=2)
    cell.announce(steps[:1], 5)
    assert cell.tokens > 0
    with pytest.raises(InvalidArgument, match="version 6"):
        cell.announce(steps[1:], 6)
    cell.end_batch()
    cell.announce(steps[1:], 6)  # a new batch may be on another version


def test_pipeline_a_tied_model_split_across_stages_needs_its_tie_group():
    from services.cell_agent.training.pipeline import PipelineCell

    with pytest.raises(InvalidArgument, match="tie group"):
        PipelineCell(StageModule(_model(tied=True), 0, 2), ranks=[0, 1], group=None)


def test_pipeline_stage_devices_follow_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cell_agent.training import service

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert service.stage_devices("auto", 1, 2) == ["cpu", "cpu"]
    assert service.stage_devices("cpu", 0, 3) == ["cpu"] * 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert service.stage_devices("auto", 1, 2) == ["cuda:2", "cuda:3"]  # cell 1's two GPUs
    assert service.stage_devices("auto", 3, 4) == ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]

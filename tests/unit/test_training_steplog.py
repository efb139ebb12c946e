"""The core's step record: TensorBoard scalars per step and kept versions (steplog.py)."""

from __future__ import annotations

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.cell_agent.training.steplog import kept_versions, step_recorder
from services.cell_agent.training.trainer import LossStats


def test_steps_become_tensorboard_scalars_and_every_nth_version_is_kept(tmp_path):
    state = {"w": torch.ones(2, 2)}
    record, close = step_recorder(
        tensorboard_dir=str(tmp_path / "tb"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        keep_every=2,
        state=lambda: state,
    )
    for version in (1, 2, 3, 4):
        stats = LossStats(tokens=10, clipped=version, weight_sum=10, weight_max=1.5, entropy_sum=20)
        stats.lag[1] = 10
        record(version, {**stats.summary(), "grad_norm": 0.5 * version})
    close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    clip = acc.Scalars("train/clip_fraction")
    assert [(e.step, round(e.value, 6)) for e in clip] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert [e.value for e in acc.Scalars("train/grad_norm")] == [0.5, 1.0, 1.5, 2.0]
    assert [e.value for e in acc.Scalars("lag/share_1")] == [1.0] * 4
    assert {"train/entropy", "train/behaviour_weight_max", "train/lag_mean"} <= set(acc.Tags()["scalars"])
    kept = kept_versions(tmp_path / "ckpt")
    assert sorted(kept) == [2, 4]
    assert torch.equal(torch.load(kept[4])["w"], state["w"])


def test_a_failed_write_never_fails_the_step(tmp_path):
    blocker = tmp_path / "ckpt"
    blocker.write_text("a file where the directory should be")
    record, close = step_recorder(tensorboard_dir="", checkpoint_dir=str(blocker), keep_every=1, state=dict)
    record(1, {"tokens": 1.0})  # logged, not raised
    close()

"""Who trains: a cell agent trains only with a ``training:`` section (or ``cfg.training``)
that does not disable it; its model falls back to the cell's own; environment overrides
apply; standalone cells and clusters without a model get the no-op hook."""

from __future__ import annotations

import types

import pytest
import yaml

from services.cell_agent.training import hook
from services.cell_agent.training.config import TrainingSettings


def _cfg(**kw):
    base = dict(kind="elastic", index=0, cell_id="c0", model_dir="/models/tiny")
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    def write(data):
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump(data))
        monkeypatch.setattr("sys.argv", ["prog", "--config", str(path)])
        return path

    monkeypatch.delenv("GYRE_CONFIG", raising=False)
    return write


def test_no_section_means_no_training(config_file):
    config_file({"cell_agent": {"engine": "mock"}})
    assert not hook.load_settings(_cfg()).enabled


def test_section_enables_and_falls_back_to_the_cell_model(config_file, monkeypatch):
    config_file({"training": {"world_size": 3, "lr": 0.01}})
    monkeypatch.setenv("GYRE_TRAINING__LR", "0.5")
    s = hook.load_settings(_cfg())
    assert s.enabled and s.world_size == 3 and s.lr == 0.5 and s.model_dir == "/models/tiny"
    config_file({"training": {"enabled": False}})
    assert not hook.load_settings(_cfg()).enabled


def test_cfg_training_wins():
    s = hook.load_settings(_cfg(training=TrainingSettings(world_size=2, model_dir="/m")))
    assert s.world_size == 2 and s.model_dir == "/m"


def test_noop_hook_for_standalone_disabled_or_modelless(config_file):
    from services.cell_agent.hooks import NoopTrainingHook

    rt = types.SimpleNamespace()
    config_file({"training": {"world_size": 2}})
    assert isinstance(hook.build_hook(rt, _cfg(kind="standalone", index=-1)), NoopTrainingHook)
    assert isinstance(hook.build_hook(rt, _cfg(model_dir="")), NoopTrainingHook)
    config_file({"training": {"enabled": False}})
    assert isinstance(hook.build_hook(rt, _cfg()), NoopTrainingHook)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        TrainingSettings(dtype="int8")
    with pytest.raises(ValueError):
        TrainingSettings(claim_wait_s=60)

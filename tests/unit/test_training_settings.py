"""Who trains, and with what: the cell agent's typed ``training`` section.

A cell trains only with a ``cell_agent.training`` section that does not disable it; its
model falls back to the cell's own; the YAML, ``GYRE_CELL_AGENT__TRAINING__<FIELD>`` and
``--set training.<field>=...`` all reach it, validated; ``mode: mock`` selects the cost-model
trainer; standalone cells and clusters without a model get the no-op hook; a file that still
has the old top-level ``training:`` section is refused with a message naming the new place."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from gyre import config as config_mod
from services.cell_agent.config import CellAgentConfig
from services.cell_agent.hooks import NoopTrainingHook
from services.cell_agent.training import hook
from services.cell_agent.training.config import MockTrainerSettings, TrainingSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GYRE_CONFIG", raising=False)
    for key in ("GYRE_CELL_AGENT__TRAINING__LR", "GYRE_CELL_AGENT__TRAINING__WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)


def load(tmp_path: Path, data: dict, **overrides: object) -> CellAgentConfig:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return config_mod.load(CellAgentConfig, path, **overrides)


def test_no_section_means_no_training(tmp_path: Path) -> None:
    cfg = load(tmp_path, {"cell_agent": {"engine": "mock", "model_dir": "/models/tiny"}})
    assert cfg.training is None
    assert not hook.load_settings(cfg).enabled


def test_yaml_env_and_set_reach_the_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = {
        "cell_agent": {
            "model_dir": "/models/tiny",
            "training": {"world_size": 3, "lr": 0.01, "max_grad_norm": 2.0},
        }
    }
    s = hook.load_settings(load(tmp_path, data))
    assert (s.enabled, s.world_size, s.lr, s.max_grad_norm, s.model_dir) == (
        True,
        3,
        0.01,
        2.0,
        "/models/tiny",
    )
    monkeypatch.setenv("GYRE_CELL_AGENT__TRAINING__LR", "0.5")
    s = hook.load_settings(load(tmp_path, data))
    assert (s.lr, s.world_size, s.max_grad_norm) == (0.5, 3, 2.0)  # env overrides one field, keeps the rest
    s = hook.load_settings(load(tmp_path, data, **{"training.world_size": 5}))
    assert (s.world_size, s.max_grad_norm) == (5, 2.0)  # --set training.world_size=5


def test_own_model_dir_wins(tmp_path: Path) -> None:
    cfg = load(tmp_path, {"cell_agent": {"model_dir": "/models/tiny", "training": {"model_dir": "/m"}}})
    assert hook.load_settings(cfg).model_dir == "/m"


def test_mode_selects_the_trainer(tmp_path: Path) -> None:
    cfg = load(tmp_path, {"cell_agent": {"training": {"mode": "mock", "time_scale": 0.5}}})
    assert isinstance(cfg.training, MockTrainerSettings) and cfg.training.time_scale == 0.5
    cfg = load(tmp_path, {"cell_agent": {"training": {"lr": 0.1}}})
    assert isinstance(cfg.training, TrainingSettings) and cfg.training.mode == "torch"


@pytest.mark.parametrize(
    "section",
    [
        {"mode": "bogus"},
        {"dtype": "int8"},
        {"claim_wait_s": 60},
        {"lr": 0.1, "time_scale": 0.5},  # a mock field in a torch section
        {"mode": "mock", "lr": 0.1},  # a torch field in a mock section
    ],
)
def test_bad_sections_are_refused(tmp_path: Path, section: dict) -> None:
    with pytest.raises(ValidationError):
        load(tmp_path, {"cell_agent": {"training": section}})


def test_old_top_level_section_is_refused_with_its_new_place(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'training:' section is now 'cell_agent.training'"):
        load(tmp_path, {"training": {"world_size": 2}})


def test_noop_hook_for_standalone_disabled_or_modelless(tmp_path: Path) -> None:
    rt = types.SimpleNamespace()
    standalone = load(
        tmp_path, {"cell_agent": {"kind": "standalone", "index": -1, "model_dir": "/m", "training": {}}}
    )
    assert isinstance(hook.build_hook(rt, standalone), NoopTrainingHook)
    modelless = load(tmp_path, {"cell_agent": {"training": {"world_size": 2}}})
    assert isinstance(hook.build_hook(rt, modelless), NoopTrainingHook)
    disabled = load(tmp_path, {"cell_agent": {"model_dir": "/m", "training": {"enabled": False}}})
    assert isinstance(hook.build_hook(rt, disabled), NoopTrainingHook)
    mock_disabled = load(tmp_path, {"cell_agent": {"training": {"mode": "mock", "enabled": False}}})
    assert isinstance(hook.build_hook(rt, mock_disabled), NoopTrainingHook)

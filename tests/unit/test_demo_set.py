"""``make demo DEMO_ARGS="--set SECTION.FIELD=VALUE"``: config overrides merged into the
cluster file section by section, nested sections included, without touching the demo's
own defaults; malformed items are refused with a message."""

from __future__ import annotations

import pytest

from apps.demo.__main__ import main
from apps.demo.runner import DEMO_OVERRIDES, DemoOptions, deep_update, parse_set


def test_set_builds_a_nested_override_read_as_yaml():
    assert parse_set("cell_agent.training.pipeline_stages=2") == {
        "cell_agent": {"training": {"pipeline_stages": 2}}
    }
    assert parse_set("scheduler.policy=waterlevel") == {"scheduler": {"policy": "waterlevel"}}


@pytest.mark.parametrize("item", ["pipeline_stages=2", "cell_agent.training.pipeline_stages", "=3"])
def test_set_refuses_what_names_no_field(item):
    with pytest.raises(ValueError, match="SECTION.FIELD=VALUE"):
        parse_set(item)


def test_deep_update_keeps_the_siblings_of_a_nested_field():
    data = {"cell_agent": {"slots": 8, "training": {"lr": 3e-4, "world_size": 3}}}
    deep_update(data, parse_set("cell_agent.training.pipeline_stages=2"))
    assert data == {
        "cell_agent": {"slots": 8, "training": {"lr": 3e-4, "world_size": 3, "pipeline_stages": 2}}
    }


def test_an_override_does_not_leak_into_the_demo_defaults():
    opts = DemoOptions()
    deep_update(opts.config_overrides, parse_set("cluster.max_staleness=3"))
    assert opts.config_overrides["cluster"]["max_staleness"] == 3
    assert DEMO_OVERRIDES["cluster"]["max_staleness"] == 1
    assert DemoOptions().config_overrides["cluster"]["max_staleness"] == 1


def test_the_demo_refuses_a_malformed_set(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--set", "nonsense"])
    assert exc.value.code == 2
    assert "SECTION.FIELD=VALUE" in capsys.readouterr().err

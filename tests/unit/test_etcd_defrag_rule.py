"""When an etcd database is worth defragmenting (gyre.etcd.maintenance.DefragRule)."""

from __future__ import annotations

import pytest

from gyre.etcd.maintenance import MB, DbSize, DefragRule


def test_due_only_when_the_free_part_is_large_in_size_and_share() -> None:
    rule = DefragRule(min_free_mb=32, min_free_share=0.5)
    assert rule.due(DbSize(file_bytes=100 * MB, in_use_bytes=40 * MB))
    assert not rule.due(DbSize(file_bytes=100 * MB, in_use_bytes=60 * MB))  # 40% free
    assert not rule.due(DbSize(file_bytes=40 * MB, in_use_bytes=10 * MB))  # 30 MB free
    assert not rule.due(DbSize(file_bytes=10 * MB, in_use_bytes=12 * MB))  # in use > file: 0 free


@pytest.mark.parametrize("kwargs", [{"min_free_mb": -1}, {"min_free_share": 1.5}, {"min_free_share": -0.1}])
def test_a_rule_out_of_range_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DefragRule(**kwargs)

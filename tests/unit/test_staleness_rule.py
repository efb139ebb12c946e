"""The one rule for groups no batch within eta can take (gyre.staleness)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.staleness import consumable, goes_on, oldest_usable, restamp_version, unconsumable


@given(st.integers(0, 50), st.booleans(), st.integers(0, 4))
def test_a_restamped_group_is_consumable_by_a_batch_still_to_come(v: int, full: bool, eta: int) -> None:
    new = restamp_version(v, full, eta)
    assert new >= v and not unconsumable(new, v, full, eta)
    assert new >= oldest_usable(v, full, eta)
    later = v + 1 if full else v  # the next batch that can still take a group
    assert consumable(new, max(later, new), eta)


def test_goes_on_only_under_partial_once_started_and_within_the_limit() -> None:
    assert not goes_on("cancel", True)
    assert not goes_on("partial", False)
    assert goes_on("partial", True) and goes_on("partial", True, 9)
    assert goes_on("partial", True, 2, 2) and not goes_on("partial", True, 3, 2)
    assert not goes_on("partial", True, 1, 0)  # a limit of 0 is the cancel rule
    with pytest.raises(ValueError, match="stale_rule"):
        goes_on("drop", True)


@given(st.integers(0, 50), st.integers(0, 4), st.integers(0, 3), st.booleans())
def test_a_first_restamp_moves_a_group_at_least_max_eta_1_versions(
    u: int, eta: int, past: int, full: bool
) -> None:
    """So a partial_max_versions below max(eta, 1) lets no group go on: it is the cancel rule."""
    v = u + eta + past
    if not unconsumable(u, v, full, eta):
        return
    assert restamp_version(v, full, eta) - u >= max(eta, 1)

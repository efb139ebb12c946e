"""The route table authorizes exactly: an unknown token or execution is UNAUTHENTICATED, a
token of another execution is PERMISSION_DENIED; a route never goes back to an older epoch
(a late event cannot undo a move), a re-created route replaces the old incarnation, and a
relist drops closed executions, whose own token then hears FAILED_PRECONDITION (closed)."""

from __future__ import annotations

import pytest

from gyre.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated
from services.router.routes import CLOSED_REMEMBERED_S, Route, RouteTable, token_sha256


def r(ex: str, cell: str, epoch: int, token: str, created: int = 1) -> Route:
    return Route(ex, cell, f"{cell}:1", token_sha256(token), "g", 1, 1, epoch, created)


def test_authorize_by_token_and_execution():
    t = RouteTable()
    t.apply(r("e1", "a", 1, "tok1"))
    t.apply(r("e2", "a", 1, "tok2"))
    assert t.authorize("tok1").execution_id == "e1"
    assert t.authorize("tok1", "e1").execution_id == "e1"
    with pytest.raises(PermissionDenied):
        t.authorize("tok2", "e1")
    with pytest.raises(Unauthenticated):
        t.authorize("nope", "e1")
    with pytest.raises(Unauthenticated):
        t.authorize("nope")
    with pytest.raises(Unauthenticated):
        t.authorize("tok1", "e9")
    with pytest.raises(Unauthenticated):
        t.authorize("")


def test_epochs_only_move_forward_and_notify():
    t = RouteTable()
    seen: list[str] = []
    t.add_listener(lambda route: seen.append(route.cell_id))
    assert t.apply(r("e1", "a", 1, "x"))
    assert t.apply(r("e1", "b", 2, "x"))
    assert not t.apply(r("e1", "a", 1, "x"))  # late event
    assert not t.apply(r("e1", "c", 2, "x"))  # same epoch
    assert t.get("e1").cell_id == "b"
    assert seen == ["a", "b"]
    # A re-created route (new create revision) starts again at version 1.
    assert t.apply(r("e1", "d", 1, "x", created=5))
    assert not t.apply(r("e1", "b", 9, "x", created=1))
    assert t.get("e1").cell_id == "d"


def test_relist_drops_closed_executions_and_their_tokens():
    t = RouteTable()
    removed: list[str] = []
    t.add_remove_listener(removed.append)
    t.apply(r("e1", "a", 1, "t1"))
    t.apply(r("e2", "a", 1, "t2"))
    t.replace_all([r("e2", "b", 2, "t2")])
    assert t.get("e1") is None and removed == ["e1"]
    with pytest.raises(FailedPrecondition):  # its token no longer serves: the execution closed
        t.authorize("t1")
    assert t.get("e2").cell_id == "b"


def test_route_json_round_trip_and_malformed():
    route = r("e1", "a", 3, "t", created=7)
    back = Route.from_json(route.to_json(), 3, created_revision=7)
    assert back == route
    with pytest.raises(InvalidArgument):
        Route.from_json(b"{not json", 1)
    with pytest.raises(InvalidArgument):
        Route.from_json(b'{"execution_id": "e"}', 1)


def test_a_view_older_than_a_route_does_not_drop_it():
    """A route read straight from etcd (a harness's first call, ahead of the watch) survives
    a mirror notification whose view predates it; one the view has seen deleted does not."""
    t = RouteTable()
    t.apply(r("old", "a", 1, "t-old", created=10))
    t.apply(r("fresh", "a", 1, "t-fresh", created=25))
    t.replace_all([], as_of_revision=20)  # the watch is at revision 20
    assert t.get("fresh") is not None and t.get("old") is None
    t.replace_all([], as_of_revision=30)  # now the view has seen the key (and its deletion)
    assert t.get("fresh") is None


def test_a_closed_execution_answers_closed_to_its_token_holder_only(monkeypatch):
    """After its route is deleted, the execution's own token hears FAILED_PRECONDITION
    (closed: HTTP 409), with or without the execution id; any other token still hears
    UNAUTHENTICATED; the memory is bounded and a re-created route is served again."""
    monkeypatch.setattr("services.router.routes.CLOSED_REMEMBERED", 2)
    t = RouteTable()
    for i in range(3):
        t.apply(r(f"e{i}", "a", 1, f"tok{i}"))
    t.remove("e0")
    with pytest.raises(FailedPrecondition, match="e0 was closed"):
        t.authorize("tok0", "e0")
    with pytest.raises(FailedPrecondition, match="e0 was closed"):
        t.authorize("tok0")
    with pytest.raises(Unauthenticated):
        t.authorize("tok1", "e0")  # another execution's token learns nothing about e0
    with pytest.raises(Unauthenticated):
        t.authorize("tok0", "e1")
    t.remove("e1")
    t.remove("e2")  # past the bound: e0 is forgotten
    with pytest.raises(Unauthenticated):
        t.authorize("tok0", "e0")
    with pytest.raises(FailedPrecondition):
        t.authorize("tok2", "e2")
    t.apply(r("e2", "b", 1, "tok2", created=5))
    assert t.authorize("tok2", "e2").cell_id == "b"


def test_a_closed_execution_is_forgotten_an_hour_after_its_close():
    """The closed memory is bounded by age as well as by count: over a run of days it holds the
    last hour's closes, not the last 65,536 (a long soak's router grew until the count bound)."""
    now = [1000.0]
    t = RouteTable(wall=lambda: now[0])
    for i in range(3):
        t.apply(r(f"e{i}", "a", 1, f"tok{i}"))
    t.remove("e0")
    now[0] += CLOSED_REMEMBERED_S - 1
    t.remove("e1")
    with pytest.raises(FailedPrecondition, match="e0 was closed"):
        t.authorize("tok0", "e0")
    now[0] += 2  # e0 closed more than an hour ago; e1 did not
    with pytest.raises(Unauthenticated):
        t.authorize("tok0", "e0")
    with pytest.raises(Unauthenticated):
        t.authorize("tok0")
    with pytest.raises(FailedPrecondition, match="e1 was closed"):
        t.authorize("tok1")
    t.remove("e2")  # a close forgets what is past the hour
    assert len(t._closed) == 2
    now[0] += CLOSED_REMEMBERED_S + 1
    t.apply(r("e3", "a", 1, "tok3"))
    t.remove("e3")
    assert len(t._closed) == 1

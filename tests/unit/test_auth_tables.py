"""Every RPC says who may call it: each service declared in protos/ is served by a servicer
whose ACCESS table covers exactly its methods (a new RPC without an entry fails here, and
the server refuses to start with it); the guard admits only the table's roles, enforces
``own`` fields, and the registration refuses a servicer without a table."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gyre.grpcx.auth import AccessTable, Guard, allow, identity_from_subject, register_guarded
from gyre.identity import Identity, Role
from gyre.v1 import cell_agent_pb2, packer_pb2, packer_pb2_grpc, router_pb2, scheduler_pb2
from services.cell_agent.servicer import CellControlServicer, EngineServicer
from services.cell_agent.snapshots import WeightSnapshotsServicer
from services.cell_agent.training.worker import TrainingControlServicer
from services.packer.servicer import PackerServicer
from services.router.servicer import RouterServicer
from services.scheduler.servicer import ControlServicer, HarnessServicer

SERVICERS = [
    HarnessServicer,
    ControlServicer,
    RouterServicer,
    PackerServicer,
    EngineServicer,
    CellControlServicer,
    WeightSnapshotsServicer,
    TrainingControlServicer,
]


def test_every_declared_service_has_a_servicer_with_a_complete_table():
    declared = set()
    for module in (scheduler_pb2, router_pb2, packer_pb2, cell_agent_pb2):
        declared |= {s.full_name for s in module.DESCRIPTOR.services_by_name.values()}
    tables = {cls.ACCESS.service for cls in SERVICERS}
    assert tables == declared
    for cls in SERVICERS:
        cls.ACCESS.check_complete()


def test_a_table_missing_a_method_or_naming_an_unknown_one_is_refused():
    rules = dict(PackerServicer.ACCESS.rules)
    del rules["SealBatch"]
    with pytest.raises(ValueError, match="SealBatch"):
        AccessTable("gyre.v1.Packer", rules).check_complete()
    with pytest.raises(ValueError, match="Bogus"):
        AccessTable(
            "gyre.v1.Packer", {**PackerServicer.ACCESS.rules, "Bogus": allow(Role.OPERATOR)}
        ).check_complete()


def test_the_documented_roles():
    # Issue 14: cell control, moves, sealing and publication only from the scheduler; claims
    # and acks only from cells, for themselves; weight snapshots only from cells; status from
    # dashboards and operators.
    assert CellControlServicer.ACCESS.rules["SetState"].roles == {Role.SCHEDULER}
    assert CellControlServicer.ACCESS.rules["LoadPolicy"].roles == {Role.SCHEDULER}
    assert RouterServicer.ACCESS.rules["MoveExecutions"].roles == {Role.SCHEDULER}
    assert PackerServicer.ACCESS.rules["SealBatch"].roles == {Role.SCHEDULER}
    for m in ("ClaimMicroSteps", "AckMicroSteps", "KeepClaims"):
        assert PackerServicer.ACCESS.rules[m] == allow(Role.CELL_AGENT, own="cell_id")
    assert WeightSnapshotsServicer.ACCESS.rules["PullSnapshot"].roles == {Role.CELL_AGENT}
    assert ControlServicer.ACCESS.rules["GetStatus"].roles == {Role.DASHBOARD, Role.OPERATOR}
    assert HarnessServicer.ACCESS.rules["AcquireExecution"].roles == {Role.HARNESS}


def test_subjects_parse_to_identities():
    assert identity_from_subject(b"CN=cell-0,OU=cell-agent,O=gyre") == Identity(Role.CELL_AGENT, "cell-0")
    assert identity_from_subject(b"CN=x,O=gyre") is None  # no role
    assert identity_from_subject(b"CN=x,OU=wizard,O=gyre") is None  # unknown role
    assert identity_from_subject(b"CN=scheduler,OU=harness,O=gyre") is None  # a role's reserved name


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self, subject: bytes | None) -> None:
        self._subject = subject
        self.code: grpc.StatusCode | None = None

    def auth_context(self):
        return {"x509_subject": [self._subject]} if self._subject else {}

    def peer(self):
        return "ipv4:127.0.0.1:1"

    async def abort(self, code, details):
        self.code = code
        raise _Aborted(details)


def test_the_guard_admits_the_tables_roles_and_own_ids_only():
    calls = []

    async def claim(request, context):
        calls.append(request.cell_id)
        return "ok"

    guard = Guard(PackerServicer.ACCESS)
    handler = guard.wrap("ClaimMicroSteps", grpc.unary_unary_rpc_method_handler(claim))
    req = packer_pb2.ClaimMicroStepsRequest(cell_id="cell-0", max_micro_steps=1)

    async def run(subject):
        ctx = _Context(subject)
        try:
            return await handler.unary_unary(req, ctx), ctx.code
        except _Aborted:
            return None, ctx.code

    assert asyncio.run(run(b"CN=cell-0,OU=cell-agent,O=gyre")) == ("ok", None)
    assert asyncio.run(run(b"CN=cell-1,OU=cell-agent,O=gyre"))[1] == grpc.StatusCode.PERMISSION_DENIED
    assert asyncio.run(run(b"CN=scheduler,OU=scheduler,O=gyre"))[1] == grpc.StatusCode.PERMISSION_DENIED
    assert asyncio.run(run(None))[1] == grpc.StatusCode.PERMISSION_DENIED
    assert calls == ["cell-0"]


def test_a_message_that_does_not_parse_is_invalid_argument_after_the_role_check():
    """The guard parses requests itself: bytes protobuf refuses (invalid UTF-8 in a string,
    a truncated field) are INVALID_ARGUMENT, not gRPC's INTERNAL; the role is checked first."""
    got = []

    async def finish(request, context):
        got.append(request.execution_id)
        return "ok"

    guard = Guard(HarnessServicer.ACCESS)
    handler = guard.wrap(
        "FinishExecution",
        grpc.unary_unary_rpc_method_handler(
            finish, request_deserializer=scheduler_pb2.FinishExecutionRequest.FromString
        ),
    )
    assert handler.request_deserializer is None  # the guarded behavior takes the bytes

    async def run(raw, subject=b"CN=harness-1,OU=harness,O=gyre"):
        ctx = _Context(subject)
        try:
            return await handler.unary_unary(raw, ctx), ctx.code
        except _Aborted:
            return None, ctx.code

    good = scheduler_pb2.FinishExecutionRequest(execution_id="ex-1").SerializeToString()
    assert asyncio.run(run(good)) == ("ok", None)
    for bad in (b"\x0a\x02\xff\xfe", b"\x0a\x09ex", b"\xff\xff\xff"):
        assert asyncio.run(run(bad))[1] == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        asyncio.run(run(b"\x0a\x02\xff\xfe", b"CN=cell-0,OU=cell-agent,O=gyre"))[1]
        == grpc.StatusCode.PERMISSION_DENIED
    )
    assert got == ["ex-1"]


def test_registration_refuses_a_servicer_without_a_table():
    class Bare(packer_pb2_grpc.PackerServicer):
        pass

    server = None  # refused before the server is touched
    with pytest.raises(TypeError, match="no ACCESS table"):
        register_guarded(server, Bare(), packer_pb2_grpc.add_PackerServicer_to_server)


def render_access_table() -> str:
    rows, seen = [], set()
    for cls in SERVICERS:
        table = cls.ACCESS
        if table.service in seen:
            continue
        seen.add(table.service)
        for m in table.methods():
            rule = table.rules[m]
            who = ", ".join(sorted(r.value for r in rule.roles)) + (
                f" (own `{rule.own}` only)" if rule.own else ""
            )
            rows.append(f"| `{table.service.split('.')[-1]}.{m}` | {who} |")
    return "| RPC | admitted roles |\n|---|---|\n" + "\n".join(rows)


def test_the_documented_table_is_the_code():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    begin = text.index("-->", text.index("<!-- access-table:begin")) + 3
    end = text.index("<!-- access-table:end -->")
    assert text[begin:end].strip() == render_access_table()
    assert TrainingControlServicer.ACCESS == CellControlServicer.ACCESS  # one CellControl table

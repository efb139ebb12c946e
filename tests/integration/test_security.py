"""Nobody gets in who doesn't belong (docs/reliability.md, promise 6), shown on real processes:
a packer, a scheduler, a router and an elastic cell agent (mock engine, with its trainer, so
WeightSnapshots is served), against an etcd with TLS and a user per identity.

Table-driven from the servicers' ACCESS tables, for every RPC of every service:
* a caller without a certificate (plaintext, TLS without a client certificate, or a
  certificate from another CA) is refused at the handshake;
* a caller with a valid certificate of a role the table does not admit gets
  PERMISSION_DENIED and nothing changes (each service's status is the same after the sweep);
  a cell claims and acks only for its own cell id;
* a forged or far-future fencing epoch neither acts nor raises any floor;
* an etcd client of one service cannot write another service's keys;
* a harness without a credential cannot acquire, and one harness cannot touch another's
  execution; per-harness limits answer RESOURCE_EXHAUSTED;
* no key, token or private key appears in any process's log.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from google.protobuf import descriptor_pool, message_factory

from apps.procs import ServiceProcess
from gyre import apikeys, certs
from gyre.errors import PermissionDenied, Unavailable
from gyre.etcd import Etcd, Keys
from gyre.etcd.server import EtcdServer
from gyre.grpcx.auth import EVERY_ROLE, AccessTable
from gyre.grpcx.channel import dial
from gyre.grpcx.tls import TlsFiles
from gyre.identity import Identity, Role
from gyre.ports import free_port
from gyre.v1 import (
    cell_agent_pb2,
    cell_agent_pb2_grpc,
    common_pb2,
    packer_pb2,
    packer_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.cell_agent.servicer import CellControlServicer, EngineServicer
from services.cell_agent.snapshots import WeightSnapshotsServicer
from services.packer.servicer import PackerServicer
from services.router.servicer import RouterServicer
from services.scheduler.servicer import ControlServicer, HarnessServicer
from testkit.router_rig import build_tokenizer_dir
from testkit.service_status import cell_status, packer_batch, router_status, scheduler_status
from testkit.tls import PKI, channel, provision_etcd, tls

pytestmark = pytest.mark.timeout(240)

FORGED = 1 << 62
CLUSTER = "sec"
SECRETS: list[str] = []
"""Keys and tokens this module saw; the last test greps every log for them."""

# service name -> (process, servicer classes served, stub classes)
SERVED = {
    "scheduler": [
        (HarnessServicer, scheduler_pb2_grpc.HarnessServiceStub),
        (ControlServicer, scheduler_pb2_grpc.SchedulerControlStub),
    ],
    "router": [(RouterServicer, router_pb2_grpc.RouterStub)],
    "packer": [(PackerServicer, packer_pb2_grpc.PackerStub)],
    "cell": [
        (EngineServicer, cell_agent_pb2_grpc.EngineStub),
        (CellControlServicer, cell_agent_pb2_grpc.CellControlStub),
        (WeightSnapshotsServicer, cell_agent_pb2_grpc.WeightSnapshotsStub),
    ],
}
EXPECT = {"scheduler": Role.SCHEDULER, "router": Role.ROUTER, "packer": Role.PACKER, "cell": Role.CELL_AGENT}


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.etcd = EtcdServer(tls_dir=PKI / "etcd", log_path=str(tmp / "etcd.log"))
        self.procs: dict[str, ServiceProcess] = {}
        self.api_key = apikeys.new_key()
        SECRETS.append(self.api_key)

    def start(self) -> Cluster:
        from apps.model.tiny import build_tiny_model

        self.etcd.start()
        asyncio.run(
            provision_etcd(self.etcd.endpoint, CLUSTER, "scheduler", "router", "packer", "cell-0", "operator")
        )
        model = build_tiny_model(self.tmp / "tiny", seed=0)
        tok = build_tokenizer_dir(self.tmp / "tok")
        keys_file = self.tmp / "harness-keys"
        keys_file.write_text(f"alice {apikeys.hash_key(self.api_key)}\n")
        cfg: dict[str, Any] = {
            "cluster": {
                "name": CLUSTER,
                "etcd_endpoints": [f"127.0.0.1:{self.etcd.client_port}"],
                "lease_ttl_s": 5,
                "log_json": True,
            },
            "packer": {"wal_dir": str(self.tmp / "wal"), "batch_size": 2},
            "router": {
                "model_dir": str(tok),
                "http_port": 0,
                "unknown_token_wait_s": 0.2,
                "unknown_token_rate_per_s": 1.0,
                "unknown_token_burst": 3,
            },
            "scheduler": {
                "policy": "rollout_only",
                "batch_size": 2,
                "group_size": 2,
                "reconcile_s": 0.1,
                "heartbeat_deadline_s": 120.0,
                "harness_keys_file": str(keys_file),
                "harness_max_inflight": 2,
                "harness_acquire_rate_per_s": 0.5,
                "harness_acquire_burst": 4,
            },
            "cell_agent": {
                "cell_id": "cell-0",
                "kind": "elastic",
                "index": 0,
                "slots": 6,
                "engine": "mock",
                "model_dir": str(model),
                "mock": {"fixed_decode_step_s": 0.002},
                "lease_ttl_s": 10,
                "training": {
                    "dtype": "float32",
                    "world_size": 1,
                    "dist_master": f"127.0.0.1:{free_port()}",
                    "claim_wait_s": 0.2,
                },
            },
        }
        path = self.tmp / "cluster.yaml"
        path.write_text(yaml.safe_dump(cfg))

        def run(name: str, service: str, **overrides: Any) -> ServiceProcess:
            proc = ServiceProcess(
                service, path, overrides=overrides, log_path=self.tmp / f"{name}.log", name=name
            )
            self.procs[name] = proc
            return proc.start(timeout_s=120)

        packer = run("packer", "packer")
        router = run("router", "router", packer_target=packer.target)
        run("scheduler", "scheduler", packer_target=packer.target, router_target=router.target)
        cfg["cell_agent"]["training"]["packer_target"] = packer.target
        path.write_text(yaml.safe_dump(cfg))
        run("cell", "cell_agent")
        self.router_url = next(
            json.loads(line)["router_http"]
            for line in router.stdout_lines
            if line.startswith("{") and "router_http" in line
        )
        return self

    def target(self, name: str) -> str:
        return self.procs[name].target

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        self.etcd.cleanup()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("security"))
    try:
        yield c.start()
    finally:
        c.stop()


def _methods() -> list[tuple[str, type, type, str]]:
    """(service, servicer class, stub class, method) for every RPC the cluster serves."""
    out = []
    for service, served in SERVED.items():
        for servicer, stub in served:
            for method in servicer.ACCESS.methods():
                out.append((service, servicer, stub, method))
    return out


METHODS = _methods()


BIDI_TRIES = 30
"""How often a bidirectional stream's refusal is read (a write racing it turned one in about
12 into INTERNAL)."""


def _request(table: AccessTable, method: str, cell_id: str = "") -> Any:
    desc = descriptor_pool.Default().FindServiceByName(table.service).methods_by_name[method]
    msg = message_factory.GetMessageClass(desc.input_type)()
    if cell_id and "cell_id" in desc.input_type.fields_by_name:
        msg.cell_id = cell_id
    if desc.client_streaming:
        # A bidirectional stream is opened and read, never written: its role is checked when
        # it opens, and a client write that meets the server's early end replaces the status
        # the server sent with INTERNAL "Internal error from Core" (grpc/grpc#36066: one
        # refusal in about 12 read that way when the stream carried one message).
        return None, True
    return msg, desc.server_streaming


async def _call(
    stub: Any, method: str, request: Any, streaming: bool, timeout: float = 5.0
) -> grpc.StatusCode:
    """The status a call ends with (OK when it returned or streamed a first message)."""
    try:
        if streaming:
            rpc = getattr(stub, method)
            call = rpc(timeout=timeout) if request is None else rpc(request, timeout=timeout)
            try:
                await call.read()
            finally:
                call.cancel()
        else:
            await getattr(stub, method)(request, timeout=timeout)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def _status(cluster: Cluster) -> dict[str, Any]:
    """What each service reports (as the operator), minus what moves on its own."""
    out: dict[str, Any] = {}
    async with channel(cluster.target("scheduler"), "operator") as ch:
        st = await scheduler_status(ch)
        out["scheduler"] = (
            st.epoch,
            st.total.dispatched,
            st.total.launched,
            st.total.finished,
            [(c.cell_id, c.state) for c in st.cells],
        )
    async with channel(cluster.target("packer"), "operator") as ch:
        b = await packer_batch(ch)
        out["packer"] = (b.batch_id, b.sealed, b.counters.produced, b.counters.consumed, b.counters.packed)
    async with channel(cluster.target("router"), "operator") as ch:
        r = await router_status(ch)
        out["router"] = (r.reroutes, r.failed_calls, r.turn_records)
    async with channel(cluster.target("cell"), "operator") as ch:
        c = await cell_status(ch)
        out["cell"] = (c.state, c.epoch, c.load.policy_version, c.load.running_requests)
    return out


async def _wait_serving(cluster: Cluster) -> None:
    deadline = time.monotonic() + 60
    while True:
        st = await _status(cluster)
        if st["scheduler"][0] > 0 and st["cell"][0] == common_pb2.CELL_STATE_ROLLOUT:
            return
        assert time.monotonic() < deadline, st
        await asyncio.sleep(0.2)


# 1. The handshake -------------------------------------------------------------------------


def test_every_served_service_has_a_complete_table():
    served = {servicer.ACCESS.service for _, servicer, _, _ in METHODS}
    pool = descriptor_pool.Default()
    declared = set()
    for module in (scheduler_pb2, router_pb2, packer_pb2, cell_agent_pb2):
        declared |= {s.full_name for s in module.DESCRIPTOR.services_by_name.values()}
    assert served == declared, "a service in protos/ that no process in this test serves"
    for _, servicer, _, _ in METHODS:
        servicer.ACCESS.check_complete()
    assert pool is not None


async def test_a_caller_without_a_certificate_is_refused_at_the_handshake(cluster, tmp_path):
    rogue = tmp_path / "rogue"
    certs.ensure(rogue, [Identity(Role.SCHEDULER, "scheduler"), Identity(Role.OPERATOR, "operator")])
    ca_only = grpc.ssl_channel_credentials((PKI / "ca" / "ca.crt").read_bytes())
    for service, servicer, stub_cls, method in METHODS:
        target = cluster.target(service)
        request, streaming = _request(servicer.ACCESS, method)
        for name, ch in (
            ("plaintext", grpc.aio.insecure_channel(target)),
            (
                "tls without a client certificate",
                grpc.aio.secure_channel(
                    target, ca_only, options=[("grpc.ssl_target_name_override", EXPECT[service].value)]
                ),
            ),
            (
                "a certificate of another CA",
                dial(target, TlsFiles.from_dir(rogue / "scheduler"), EXPECT[service]),
            ),
        ):
            async with ch:
                code = await _call(stub_cls(ch), method, request, streaming, timeout=3)
            assert code == grpc.StatusCode.UNAVAILABLE, f"{service} {method} {name}: {code}"
    # The same holds for etcd.
    with pytest.raises(Unavailable):  # no endpoint answers a plaintext client
        async with Etcd([f"http://127.0.0.1:{cluster.etcd.client_port}"], timeout_s=2) as plain:
            await plain.get(b"/gyre/")


# 2. Roles ---------------------------------------------------------------------------------


async def test_a_role_the_table_does_not_admit_gets_permission_denied_and_changes_nothing(cluster):
    await _wait_serving(cluster)
    before = await _status(cluster)
    checked = 0
    channels: dict[str, grpc.aio.Channel] = {}
    try:
        for service, servicer, stub_cls, method in METHODS:
            rule = servicer.ACCESS.rules[method]
            for role in sorted(EVERY_ROLE - rule.roles, key=lambda r: r.value):
                name = "cell-1" if role is Role.CELL_AGENT else role.value
                key = f"{service}/{name}"
                if key not in channels:
                    channels[key] = channel(cluster.target(service), name, role, EXPECT[service])
                request, streaming = _request(servicer.ACCESS, method, cell_id="cell-0")
                # A stream's refusal races the call's opening: it is read many times.
                for _ in range(BIDI_TRIES if request is None else 1):  # None: a bidi stream
                    code = await _call(stub_cls(channels[key]), method, request, streaming)
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (
                        f"{service} {method} as {role.value}: {code}"
                    )
                checked += 1
            if rule.own:  # an admitted role, acting for another cell
                key = f"{service}/cell-1"
                channels.setdefault(
                    key, channel(cluster.target(service), "cell-1", Role.CELL_AGENT, EXPECT[service])
                )
                request, streaming = _request(servicer.ACCESS, method, cell_id="cell-0")
                code = await _call(stub_cls(channels[key]), method, request, streaming)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (
                    f"{service} {method} for another cell: {code}"
                )
                checked += 1
    finally:
        for ch in channels.values():
            await ch.close()
    assert checked > 60
    assert await _status(cluster) == before


# 3. Fencing -------------------------------------------------------------------------------


async def test_forged_epochs_neither_act_nor_raise_a_floor(cluster):
    await _wait_serving(cluster)
    before = await _status(cluster)
    epoch = before["scheduler"][0]
    fence = common_pb2.Fence(epoch=FORGED)
    forged = [
        (
            "router",
            router_pb2_grpc.RouterStub,
            "MoveExecutions",
            router_pb2.MoveExecutionsRequest(fence=fence),
        ),
        ("packer", packer_pb2_grpc.PackerStub, "SealBatch", packer_pb2.SealBatchRequest(fence=fence)),
        (
            "cell",
            cell_agent_pb2_grpc.CellControlStub,
            "SetState",
            cell_agent_pb2.SetStateRequest(fence=fence, target=common_pb2.CELL_STATE_FAILED),
        ),
        (
            "cell",
            cell_agent_pb2_grpc.CellControlStub,
            "LoadPolicy",
            cell_agent_pb2.LoadPolicyRequest(fence=fence, version=99, source_target="127.0.0.1:1"),
        ),
        (
            "cell",
            cell_agent_pb2_grpc.CellControlStub,
            "JoinBatch",
            cell_agent_pb2.JoinBatchRequest(fence=fence, batch_id=1, prefix_size=1),
        ),
    ]
    for service, stub_cls, method, request in forged:
        async with channel(cluster.target(service), "scheduler", expect=EXPECT[service]) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await getattr(stub_cls(ch), method)(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (
                service,
                method,
                err.value.details(),
            )
    assert await _status(cluster) == before  # the cell did not fail, nothing loaded
    # No floor moved: the real leader's epoch is still accepted everywhere.
    async with channel(cluster.target("router"), "scheduler", expect=Role.ROUTER) as ch:
        await router_pb2_grpc.RouterStub(ch).MoveExecutions(
            router_pb2.MoveExecutionsRequest(fence=common_pb2.Fence(epoch=epoch)), timeout=10
        )
    async with channel(cluster.target("packer"), "scheduler", expect=Role.PACKER) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:  # nothing to seal, but not for the epoch
            await packer_pb2_grpc.PackerStub(ch).SealBatch(
                packer_pb2.SealBatchRequest(fence=common_pb2.Fence(epoch=epoch)), timeout=10
            )
        assert "epoch" not in err.value.details()
    assert (await _status(cluster))["cell"][1] == before["cell"][1] < FORGED


# 4. etcd ----------------------------------------------------------------------------------


async def test_an_etcd_client_cannot_write_another_services_keys(cluster):
    keys = Keys(CLUSTER)
    foreign = {
        "scheduler": [
            keys.cell("cell-0"),
            keys.cell_state("cell-0"),
            keys.policy(),
            keys.services("router") + b"x",
        ],
        "router": [keys.leader(), keys.route("x"), keys.execution(1, "x"), keys.cell("cell-0")],
        "packer": [keys.leader(), keys.route("x"), keys.policy(), keys.services("router") + b"x"],
        "cell-0": [
            keys.cell("cell-1"),
            keys.cell_state("cell-1"),
            keys.leader(),
            keys.route("x"),
            keys.services("scheduler") + b"x",
        ],
        "operator": [keys.leader(), keys.policy(), keys.cell("cell-0")],
    }
    endpoint = f"https://127.0.0.1:{cluster.etcd.client_port}"
    for name, denied in foreign.items():
        async with Etcd([endpoint], timeout_s=5, tls=tls(name)) as etcd:
            assert await etcd.get(keys.leader()) is not None  # reads are allowed
            for key in denied:
                with pytest.raises(PermissionDenied):
                    await etcd.put(key, b"{}")
    async with Etcd([endpoint], timeout_s=5, tls=tls("packer")) as etcd:  # its own prefix: allowed
        await etcd.put(f"{keys.root}packer/probe".encode(), b"1")
        await etcd.delete(f"{keys.root}packer/probe".encode())


# 5. Harnesses -----------------------------------------------------------------------------


def _harness(cluster: Cluster, name: str, key: str | None = None) -> tuple[grpc.aio.Channel, Any, tuple]:
    ch = channel(cluster.target("scheduler"), name, Role.HARNESS, Role.SCHEDULER)
    md = ((apikeys.METADATA_KEY, key),) if key else ()
    return ch, scheduler_pb2_grpc.HarnessServiceStub(ch), md


async def _acquire(stub: Any, md: tuple, wait_s: float = 10.0) -> scheduler_pb2.Execution:
    r = await stub.AcquireExecution(
        scheduler_pb2.AcquireExecutionRequest(harness_id="h", wait_s=wait_s), metadata=md, timeout=wait_s + 5
    )
    assert r.HasField("execution")
    SECRETS.append(r.execution.token)
    return r.execution


async def test_harness_credentials_ownership_and_limits(cluster):
    await _wait_serving(cluster)
    acquire = scheduler_pb2.AcquireExecutionRequest(harness_id="h", wait_s=0)
    # Not a harness: refused before anything happens; a wrong API key: UNAUTHENTICATED.
    async with channel(cluster.target("scheduler"), "operator", expect=Role.SCHEDULER) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scheduler_pb2_grpc.HarnessServiceStub(ch).AcquireExecution(acquire, timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    ch_x, stub_x, _ = _harness(cluster, "harness-x")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub_x.AcquireExecution(acquire, metadata=((apikeys.METADATA_KEY, "gyre_wrong"),), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await ch_x.close()

    ch_a, stub_a, md_a = _harness(cluster, "harness-a")
    ch_b, stub_b, md_b = _harness(cluster, "harness-b")
    ch_k, stub_k, md_k = _harness(cluster, "harness", cluster.api_key)
    try:
        a = await _acquire(stub_a, md_a)
        k = await _acquire(stub_k, md_k)  # the API key names the harness: "key:alice"
        b = await _acquire(stub_b, md_b)
        before = await _status(cluster)

        # harness-b holds a's token (a leak) but not a's execution.
        md = (("authorization", f"Bearer {a.token}"),)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub_b.Heartbeat(
                scheduler_pb2.HeartbeatRequest(execution_id=a.execution_id), metadata=md, timeout=5
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub_b.FinishExecution(
                scheduler_pb2.FinishExecutionRequest(
                    execution_id=a.execution_id,
                    status=common_pb2.EXECUTION_STATUS_FAILED,
                    idempotency_key="x",
                ),
                metadata=md,
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Its own token on a's execution: PERMISSION_DENIED at the scheduler and the router.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub_b.Heartbeat(
                scheduler_pb2.HeartbeatRequest(execution_id=a.execution_id),
                metadata=(("authorization", f"Bearer {b.token}"),),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with channel(cluster.target("router"), "harness-b", Role.HARNESS, Role.ROUTER) as rch:
            call = router_pb2_grpc.RouterStub(rch).Generate(
                router_pb2.GenerateRequest(
                    execution_id=a.execution_id,
                    prompt_token_ids=[5, 6],
                    sampling=common_pb2.SamplingParams(max_tokens=2),
                ),
                metadata=(("authorization", f"Bearer {b.token}"),),
                timeout=5,
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # The API-key harness is a different harness from the certificate it shares.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub_a.Heartbeat(
                scheduler_pb2.HeartbeatRequest(execution_id=k.execution_id),
                metadata=(("authorization", f"Bearer {k.token}"),),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert await _status(cluster) == before

        # The owner may: heartbeat, then close (which revokes the token at the router).
        await stub_a.Heartbeat(
            scheduler_pb2.HeartbeatRequest(execution_id=a.execution_id), metadata=md, timeout=5
        )
        await stub_a.FinishExecution(
            scheduler_pb2.FinishExecutionRequest(
                execution_id=a.execution_id, status=common_pb2.EXECUTION_STATUS_CANCELLED, idempotency_key="a"
            ),
            metadata=md,
            timeout=5,
        )
        # Once the route deletion reaches the router's watch, the token is refused: 409 (its
        # execution closed) to its holder. Until then the call is authorized and refused for
        # its model (404, before any engine is asked): CI once posted before the watch had it.
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                async with http.post(
                    f"{cluster.router_url}/chat/completions",
                    headers={"Authorization": f"Bearer {a.token}"},
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                ) as resp:
                    status, text = resp.status, await resp.text()
                if status != 404:
                    break
                await asyncio.sleep(0.1)
            assert status == 409 and "closed" in text, (status, text)

        # Limits: harness-b may hold 2 executions; its acquire rate is 0.5/s after a burst of 4.
        await _acquire(stub_b, md_b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _acquire(stub_b, md_b, wait_s=0)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        codes = []
        for _ in range(3):
            try:
                await stub_b.AcquireExecution(acquire, timeout=5)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
    finally:
        for ch in (ch_a, ch_b, ch_k):
            await ch.close()


async def test_unknown_tokens_are_answered_from_memory_and_rate_limited(cluster):
    codes = []
    async with aiohttp.ClientSession() as http:
        for i in range(8):
            async with http.post(
                f"{cluster.router_url}/chat/completions",
                headers={"Authorization": f"Bearer forged-{i}"},
                json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
            ) as resp:
                codes.append(resp.status)
    assert set(codes) == {401, 429} and codes.index(429) > codes.index(401), codes
    await _status(cluster)  # still healthy


# 6. Secrets -------------------------------------------------------------------------------


def test_no_secret_appears_in_any_log(cluster):
    assert len(SECRETS) >= 2
    private_lines = set()
    for key_file in PKI.glob("*/tls.key"):
        private_lines |= {line for line in key_file.read_text().splitlines() if "-----" not in line}
    logs = {p.name: p.read_text(errors="replace") for p in cluster.tmp.glob("*.log")}
    assert set(logs) >= {"packer.log", "router.log", "scheduler.log", "cell.log"}
    for name, text in logs.items():
        for secret in SECRETS:
            assert secret not in text, f"a key or token in {name}"
        for line in private_lines:
            assert line not in text, f"private key material in {name}"

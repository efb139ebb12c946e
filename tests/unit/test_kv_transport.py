"""The KV handoff protocol on the ``tcp`` transport, between two paged caches in this
process (no vLLM): pin -> (request finishes, writes stop) -> read -> release. A read waits
for the seal, copies exactly the pinned blocks into the destination's blocks, serves only
the prefix the token sequences share, and fails cleanly (KvReadError, never a hang) on a
released, expired or unknown pin, a dead source or a timeout. Held blocks are freed on
release and on expiry, never while a read copies them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.cell_agent.engines.kv_transport import (
    KvReadError,
    KvServer,
    PagedCaches,
    PinTable,
    ReadSpec,
    common_blocks,
    read,
)

B = 4  # block size
NUM_BLOCKS = 16
LAYERS = ("l0", "l1")


def _caches(fill: bool) -> PagedCaches:
    # vLLM-CPU's layout: [num_blocks, 2 (K/V), heads, block, head_dim]; GPU layouts put the
    # block dimension second.
    tensors = {}
    for i, name in enumerate(LAYERS):
        shape = (NUM_BLOCKS, 2, 2, B, 8) if i == 0 else (2, NUM_BLOCKS, B, 2, 8)
        t = torch.zeros(shape, dtype=torch.bfloat16)
        if fill:
            t.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16))
        tensors[name] = t
    return PagedCaches(tensors, NUM_BLOCKS)


@pytest.fixture
def source():
    table = PinTable()
    caches = _caches(fill=True)
    server = KvServer(table, caches, B)
    try:
        yield table, caches, server
    finally:
        server.close()


TOKENS = list(range(100, 123))  # 23 tokens: 5 whole blocks + 3
SRC_BLOCKS = [9, 3, 7, 1, 12, 5]


def _pin_finished(table: PinTable, handle: str = "h1", ttl_s: float = 30.0, seal: bool = True) -> None:
    table.pin(handle, "r1", ttl_s)
    assert table.finish("r1", TOKENS, SRC_BLOCKS, num_tokens=len(TOKENS))
    if seal:
        table.seal({"r1"})


def _spec(
    server: KvServer,
    handle: str = "h1",
    tokens=None,
    first: int = 0,
    dst=(2, 4, 6, 8, 10),
    timeout_s: float = 2.0,
):
    return ReadSpec(
        server.locator, handle, "tcp", list(TOKENS if tokens is None else tokens), first, list(dst), timeout_s
    )


def _same_blocks(src: PagedCaches, src_ids: list[int], dst: PagedCaches, dst_ids: list[int]) -> bool:
    return all(torch.equal(src.gather(n, src_ids), dst.gather(n, dst_ids)) for n in LAYERS)


def test_read_copies_the_pinned_blocks_into_the_destination_blocks(source):
    table, caches, server = source
    _pin_finished(table)
    dst = _caches(fill=False)
    assert read(_spec(server), dst) == 5
    assert _same_blocks(caches, SRC_BLOCKS[:5], dst, [2, 4, 6, 8, 10])
    # A destination that already holds the first two blocks reads only the rest.
    dst2 = _caches(fill=False)
    assert read(_spec(server, first=2, dst=(0, 1, 2)), dst2) == 3
    assert _same_blocks(caches, SRC_BLOCKS[2:5], dst2, [0, 1, 2])


def test_only_the_shared_prefix_is_served(source):
    table, caches, server = source
    _pin_finished(table)
    other = TOKENS[:9] + [999] + TOKENS[10:]  # differs in block 2
    dst = _caches(fill=False)
    assert read(_spec(server, tokens=other), dst) == 2
    assert _same_blocks(caches, SRC_BLOCKS[:2], dst, [2, 4])
    assert common_blocks(TOKENS, other, available=len(TOKENS), block_size=B) == 2
    assert common_blocks(TOKENS, TOKENS, available=6, block_size=B) == 1  # KV written for 6 only


def test_a_read_waits_until_writes_stop(source):
    table, _, server = source
    _pin_finished(table, seal=False)
    threading.Timer(0.2, table.seal, args=({"r1"},)).start()
    t0 = time.monotonic()
    assert read(_spec(server), _caches(fill=False)) == 5
    assert time.monotonic() - t0 >= 0.15


def test_an_unsealed_pin_times_out(source):
    table, _, server = source
    _pin_finished(table, seal=False)
    with pytest.raises(KvReadError, match="not sealed"):
        read(_spec(server, timeout_s=0.3), _caches(fill=False))


@pytest.mark.parametrize("case", ["unknown", "released"])
def test_no_live_pin_is_refused(source, case):
    table, _, server = source
    _pin_finished(table)
    if case == "released":
        table.release("h1")
    with pytest.raises(KvReadError, match="no live pin"):
        read(_spec(server, handle="h1" if case == "released" else "nope"), _caches(fill=False))


def test_a_dead_source_fails_the_read(source):
    table, _, server = source
    _pin_finished(table)
    server.close()
    with pytest.raises(KvReadError):
        read(_spec(server, timeout_s=0.5), _caches(fill=False))


def test_unknown_medium_is_refused(source):
    _, _, server = source
    spec = ReadSpec(server.locator, "h1", "carrier-pigeon", TOKENS, 0, [1], 1.0)
    with pytest.raises(KvReadError, match="not supported"):
        read(spec, _caches(fill=False))


def test_held_blocks_are_freed_on_release_not_while_read():
    table = PinTable()
    _pin_finished(table)
    assert table.take_releasable() == set()
    with table.reading("h1", 1.0):
        table.release("h1")
        assert table.take_releasable() == set()  # a read is copying them
    assert table.take_releasable() == {"r1"}
    assert len(table) == 0 and table.take_releasable() == set()
    table.release("h1")  # idempotent


def test_held_blocks_are_freed_on_expiry():
    table = PinTable()
    _pin_finished(table, ttl_s=0.05)
    time.sleep(0.1)
    assert table.take_releasable() == {"r1"}
    assert len(table) == 0


def test_a_pin_released_before_its_request_finishes_holds_nothing():
    table = PinTable()
    table.pin("h1", "r1", 30.0)
    table.release("h1")
    assert not table.finish("r1", TOKENS, SRC_BLOCKS, len(TOKENS))
    assert len(table) == 0
    table.pin("h2", "r2", 0.01)  # expires before its request finishes
    time.sleep(0.05)
    table.expire_unfinished()
    assert len(table) == 0


def test_with_tls_only_cell_agents_read():
    from gyre.identity import Role
    from testkit.tls import kv_tls

    table = PinTable()
    caches = _caches(fill=True)
    server = KvServer(table, caches, B, tls=kv_tls("cell-a"))
    try:
        _pin_finished(table)
        dst = _caches(fill=False)
        assert read(_spec(server), dst, tls=kv_tls("cell-b")) == 5  # mutual TLS, both cells
        assert _same_blocks(caches, SRC_BLOCKS[:5], dst, [2, 4, 6, 8, 10])
        with pytest.raises(KvReadError):
            read(_spec(server), _caches(fill=False))  # plaintext: no handshake, no blocks
        with pytest.raises(KvReadError):
            read(_spec(server), _caches(fill=False), tls=kv_tls("router", Role.ROUTER))  # not a cell
    finally:
        server.close()

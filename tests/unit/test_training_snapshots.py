"""Weight snapshots are immutable and travel intact: a version is a frozen copy (later
writes to the model do not change it), chunked streams reassemble bit-exactly for every
dtype and chunk size, and a torn, reordered or mixed-version stream is refused."""

from __future__ import annotations

import pytest
import torch

from gyre.errors import InvalidArgument, NotFound
from services.cell_agent.snapshots import SnapshotStore, _Assembly, iter_chunks


def _state():
    torch.manual_seed(0)
    return {
        "a": torch.randn(37, 11),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.randn(3, 3, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_round_trip_is_exact(chunk):
    store = SnapshotStore()
    state = _state()
    snap = store.publish(4, state)
    asm = _Assembly(4)
    for c in iter_chunks(snap, chunk):
        asm.add(c)
    got = asm.result()
    assert list(got) == list(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v)


def test_snapshots_are_immutable_and_bounded():
    store = SnapshotStore(keep=2)
    state = _state()
    store.publish(1, state)
    state["a"].add_(1.0)
    assert not torch.equal(store.get(1).state_dict()["a"], state["a"])
    store.publish(2, state)
    store.publish(3, state)
    assert store.versions() == [2, 3] and store.get(0).version == 3
    with pytest.raises(NotFound):
        store.get(1)
    with pytest.raises(InvalidArgument):
        store.publish(1, state)  # older than the newest and not kept
    assert store.publish(3, {}).version == 3  # re-publishing a kept version is a no-op


def test_torn_or_mixed_streams_are_refused():
    store = SnapshotStore(keep=4)
    chunks = list(iter_chunks(store.publish(1, _state()), 64))
    asm = _Assembly(1)
    for c in chunks[:-1]:
        asm.add(c)
    with pytest.raises(InvalidArgument, match="early"):
        asm.result()
    asm = _Assembly(1)
    asm.add(chunks[0])
    with pytest.raises(InvalidArgument, match="out of order"):
        asm.add(chunks[0])  # a duplicated chunk
    other = list(iter_chunks(store.publish(2, _state()), 64))
    asm = _Assembly(0)
    asm.add(chunks[0])
    with pytest.raises(InvalidArgument, match="mixed"):
        asm.add(other[1])
    with pytest.raises(InvalidArgument, match="asked for"):
        _Assembly(2).add(chunks[0])

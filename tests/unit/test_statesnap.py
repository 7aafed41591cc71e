"""Tier 0 for a script's own state (lazarus.trainer.statesnap): what goes in comes back, with
its structure and types, and a file that is not such a snapshot is refused by name."""

from __future__ import annotations

import pytest
import torch

from lazarus.core import snapshotfile
from lazarus.core.snapshotfile import SnapshotError
from lazarus.trainer import statesnap


def _state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(),
            "data": {"epoch": 3, "cursor": [7, 9], "name": "shard-2", "done": False,
                     "best": None, "pair": (1, 2.5)}}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b and type(a) is type(b)


def test_a_state_comes_back_with_its_structure_and_types(tmp_path):
    state = _state()
    written = []
    snaps = statesnap.StateSnapshots(tmp_path, header={"job": "J", "round": 2, "rank": 1,
                                                       "world_size": 4},
                                     on_written=lambda step, path: written.append((step, path)))
    snaps.take(12, state)
    snaps.close()
    (step, path), = written
    assert step == 12 and path.endswith("r00001-s0000000012.t0")
    got_step, got = statesnap.read(path, rank=1, world_size=4)
    assert got_step == 12 and _same(state, got)
    assert list(got["optim"]["state"]) == [0, 1]  # the optimizer's int keys stay ints
    # what the script restores into an optimizer is its own memory, not the mapped file
    assert all(t.is_contiguous() and t.data_ptr() for t in got["optim"]["state"][0].values()
               if isinstance(t, torch.Tensor))
    with pytest.raises(SnapshotError, match="is rank 1 of 4, this is rank 0 of 4"):
        statesnap.read(path, rank=0, world_size=4)


def test_restored_into_the_live_state_in_place():
    saved = _state()
    live = _state()
    for t in live["model"].values():
        t.zero_()
    tensors, skeleton = statesnap.flatten(saved)
    out = statesnap.copy_into(statesnap.rebuild(skeleton, tensors, "t"), live, "t")
    assert out["model"]["weight"] is live["model"]["weight"]  # the live tensor, refilled
    assert torch.equal(live["model"]["weight"], saved["model"]["weight"])
    assert out["data"]["epoch"] == 3
    live["model"]["weight"] = torch.zeros(5, 5)
    with pytest.raises(SnapshotError, match=r"/model/weight is \(2, 3\) torch.float32 in the "
                                            r"snapshot, \(5, 5\) torch.float32 here"):
        statesnap.copy_into(statesnap.rebuild(skeleton, tensors, "t"), live, "t")


@pytest.mark.parametrize("state, words", [
    ({"f": lambda: 0}, "a state leaf must be a tensor or a JSON value, got function"),
    ({("a", 1): 0}, "a state dict key must be a str or an int"),
])
def test_a_state_it_cannot_hold_is_one_line(state, words):
    with pytest.raises(ValueError, match=words):
        statesnap.flatten(state)


@pytest.mark.parametrize("skeleton", [{"T": "9"}, {"x": 1}, {"d": [[1]]}, [], {"l": 3}])
def test_a_garbled_skeleton_is_refused(skeleton, tmp_path):
    path = tmp_path / "bad.t0"
    path.write_bytes(b"".join(snapshotfile.pack_parts(
        {"job": "J", "round": 1, "rank": 0, "world_size": 1, "step": 1, "skeleton": skeleton,
         "rng": {}}, b"\x02\x00\x00\x00\x00\x00\x00\x00{}")))
    with pytest.raises(SnapshotError):
        statesnap.read(str(path), rank=0, world_size=1)


def test_a_garbled_rng_state_is_refused(tmp_path):
    path = tmp_path / "bad.t0"
    path.write_bytes(b"".join(snapshotfile.pack_parts(
        {"job": "J", "round": 1, "rank": 0, "world_size": 1, "step": 1, "skeleton": {"v": 1},
         "rng": {}},
        b"\x02\x00\x00\x00\x00\x00\x00\x00{}")))
    with pytest.raises(SnapshotError, match="its RNG state is malformed"):
        statesnap.read(str(path), rank=0, world_size=1)

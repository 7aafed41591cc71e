"""Tier-0 snapshot files (lazarus.core.snapshotfile, lazarus.trainer.snapshot): a round trip
gives back the very state, nothing is unpickled, and damaged bytes are refused by name."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus.core import snapshotfile
from lazarus.core.snapshotfile import SnapshotError
from lazarus.trainer import snapshot
from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import build_optimizer


def _trained(seed: int):
    torch.manual_seed(seed)
    model = Transformer(get_model_config("tiny"))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    for _ in range(2):
        model(torch.randint(0, 100, (2, 16))).float().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _file(model, opt, **extra) -> bytes:
    tensors, values = snapshot.capture(model, opt)
    header = {"job": "j1", "round": 3, "rank": 0, "world_size": 1, "step": 17,
              "extra": {"step": 17, "loader": {"cursor": 136}, **extra},
              "rng": snapshot.rng_state()}
    return snapshot.encode(tensors, values, header=header)


@pytest.fixture(scope="module")
def saved():
    model, opt = _trained(1)
    torch.manual_seed(1234)
    data = _file(model, opt)
    expected_draw = torch.rand(4)  # what the RNG gives next, after the snapshot
    return model, opt, data, expected_draw


def test_a_round_trip_restores_model_optimizer_data_position_and_rng(saved):
    model, opt, data, expected_draw = saved
    fresh, fresh_opt = _trained(2)  # other weights, other moments
    torch.manual_seed(999)
    header = snapshot.restore(data, fresh, fresh_opt, rank=0, world_size=1)
    assert header["extra"]["loader"] == {"cursor": 136} and header["step"] == 17
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    assert torch.equal(torch.rand(4), expected_draw)


def test_a_fresh_optimizer_gets_the_state_without_a_step_and_trains_on_alike(saved, monkeypatch):
    # A restarted rank's optimizer has no state yet; DCP would make one with a zero-gradient
    # step over the whole shard, which the restore allocates instead.
    import torch.distributed.checkpoint.state_dict as dcp_state
    model, opt, data, _ = saved
    fresh = Transformer(get_model_config("tiny"))
    fresh_opt = build_optimizer(fresh, lr=1e-3, weight_decay=0.1)
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda *a, **k: pytest.fail("stepped"))
    snapshot.restore(data, fresh, fresh_opt, rank=0, world_size=1)
    monkeypatch.undo()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert set(fresh_opt.state[q]) == set(opt.state[p])
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    assert dcp_state.get_state_dict(fresh, fresh_opt)  # a state DCP takes as it is
    # The next step from it is the step from the same snapshot restored into an optimizer
    # that had a state of its own (the path through DCP's own allocation).
    other, other_opt = _trained(3)
    snapshot.restore(data, other, other_opt, rank=0, world_size=1)
    batch = torch.randint(0, 100, (2, 16))
    for m, o in ((fresh, fresh_opt), (other, other_opt)):
        m(batch).float().mean().backward()
        o.step()
    for p, q in zip(fresh.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_restoring_unpickles_nothing(saved, monkeypatch):
    _, _, data, _ = saved

    def refuse(*_a, **_k):
        raise AssertionError("a snapshot was unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    fresh, fresh_opt = _trained(2)
    snapshot.restore(data, fresh, fresh_opt, rank=0, world_size=1)
    # the body is safetensors: an 8-byte length and a JSON index, then raw tensor bytes
    _, raw = snapshotfile.unpack(data)
    index = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert "model/tok_embeddings.weight" in index or any(k.startswith("model/") for k in index)


@settings(max_examples=60, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_is_refused(saved, where, bit):
    _, _, data, _ = saved
    damaged = bytearray(data)
    damaged[int(where * len(data))] ^= 1 << bit
    with pytest.raises(SnapshotError, match="sha256 checksum|not a tier-0 snapshot"):
        snapshotfile.unpack(bytes(damaged))


@pytest.mark.parametrize("cut", [0, 3, 20, -1, -40])
def test_a_file_cut_short_is_refused(saved, cut):
    _, _, data, _ = saved
    with pytest.raises(SnapshotError):
        snapshotfile.unpack(data[:cut])


def test_a_garbled_header_is_named_even_without_the_checksum(saved):
    _, _, data, _ = saved
    with pytest.raises(SnapshotError, match="not a tier-0 snapshot"):
        snapshotfile.read_header(b"PK\x03\x04" + data[4:])
    start = len(snapshotfile.MAGIC) + 4
    with pytest.raises(SnapshotError, match="header is not JSON"):
        snapshotfile.read_header(data[:start] + b"}" + data[start + 1:])


def test_a_snapshot_of_another_rank_or_mesh_is_refused(saved):
    _, _, data, _ = saved
    fresh, fresh_opt = _trained(2)
    with pytest.raises(SnapshotError, match="rank 0 of 1, this is rank 1 of 2"):
        snapshot.restore(data, fresh, fresh_opt, rank=1, world_size=2)


def test_a_snapshot_of_another_model_is_refused(saved):
    _, _, data, _ = saved
    other = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(SnapshotError, match="does not fit this model"):
        snapshot.restore(data, other, opt, rank=0, world_size=1)


def test_each_snapshot_gives_a_memory_stall_line_timed_to_its_peer_copy(tmp_path):
    """The tier-0 line of metrics.jsonl (lazarus.core.stall): blocked while `take` held the
    loop, durable when the agent said the copy was on the peer, null when it never got there;
    a rank that finished writes a line for every snapshot it took."""
    import time

    from lazarus.core.stall import CheckpointStall

    model, opt = _trained(3)
    written, acks = [], []

    def kept():
        out, acks[:] = list(acks), []
        return out

    snaps = snapshot.Snapshotter(tmp_path, every=1, first_step=0, kept=kept,
                                 header={"job": "j", "round": 1, "rank": 0, "world_size": 4},
                                 on_written=lambda step, path: written.append(step))
    started = time.perf_counter()
    blocked = [snaps.take(step, model, opt, {"step": step}) for step in (1, 2, 3)]
    snaps.wait()
    assert written == [1, 2, 3] and snaps.stalls() == []  # nothing settled yet
    acks += [(2, False, time.perf_counter()), (1, True, time.perf_counter())]
    got = snaps.stalls()
    assert [(s.step, s.tier, s.ranks) for s in got] == [(1, "memory", 4), (2, "memory", 4)]
    assert got[0].blocked_s == blocked[0] and got[1].blocked_s == blocked[1]
    assert 0 < got[0].durable_s <= time.perf_counter() - started
    assert got[1].durable_s is None  # overtaken on its way to the peer
    snaps.close(settle_s=0.05)  # step 3 is never settled
    (last,) = snaps.stalls()
    assert (last.step, last.durable_s) == (3, None)
    assert CheckpointStall.from_row(last.to_row()).durable_s is None


def test_a_snapshot_reusing_the_last_ones_buffers_holds_the_new_state(tmp_path):
    model, opt = _trained(4)
    files = {}
    snaps = snapshot.Snapshotter(tmp_path, every=1, first_step=0,
                                 header={"job": "j", "round": 1, "rank": 0, "world_size": 1},
                                 on_written=lambda step, path: files.setdefault(step, path))
    snaps.take(1, model, opt, {"step": 1})
    model(torch.randint(0, 100, (2, 16))).float().mean().backward()
    opt.step()  # new weights and moments, into the same buffers
    snaps.take(2, model, opt, {"step": 2})
    snaps.close()
    fresh, fresh_opt = _trained(5)
    snapshot.restore(snapshot.load_file(files[2]), fresh, fresh_opt, rank=0, world_size=1)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    old, _ = _trained(5)
    snapshot.restore(snapshot.load_file(files[1]), old, build_optimizer(old, lr=1e-3,
                                                                        weight_decay=0.1),
                     rank=0, world_size=1)
    assert not all(torch.equal(a, b) for a, b in zip(old.parameters(), fresh.parameters()))


def test_the_automatic_period_bounds_the_stall_and_keeps_one_snapshot_in_flight():
    # 2 ms stall on a 1 s step: under 1% every step, so long as a copy is durable within it.
    assert snapshot.auto_period(0.002, [1.0, 1.2, 0.9], []) == 1
    assert snapshot.auto_period(0.002, [1.0, 1.2, 0.9], [0.5, 0.8]) == 1
    # A copy that takes 2.3 s to reach its peer: the next one waits for it.
    assert snapshot.auto_period(0.002, [1.0, 1.2, 0.9], [2.3, 2.1, 9.0]) == 3
    # The stall alone: 50 ms against 1% of a 1 s step.
    assert snapshot.auto_period(0.05, [1.0], [0.1]) == 5
    assert snapshot.auto_period(0.05, [], [3.0]) == 1          # nothing timed yet
    assert snapshot.auto_period(60.0, [0.001], []) == snapshot.MAX_AUTO_EVERY


def test_the_copier_captures_what_capture_does_and_follows_a_replaced_state():
    model, opt = _trained(4)
    copier = snapshot.ShardCopier()
    first, _ = copier.capture(model, opt)
    model(torch.randint(0, 100, (2, 16))).float().mean().backward()
    opt.step()  # in place: the copier's sources are still the live state
    opt.param_groups[0]["lr"] = 0.25
    tensors, values = copier.capture(model, opt, into=first)
    want_tensors, want_values = snapshot.capture(model, opt)
    assert values == want_values and values["optim/param_groups/0/lr"] == 0.25
    assert tensors.keys() == want_tensors.keys()
    assert all(torch.equal(tensors[k], want_tensors[k]) for k in tensors)
    assert tensors["model/output.weight"] is first["model/output.weight"]  # into the buffers
    # A state replaced wholesale (a load_state_dict) is found again, not copied from stale
    # tensors.
    other, other_opt = _trained(5)
    opt.load_state_dict(other_opt.state_dict())
    tensors, _ = copier.capture(model, opt, into=first)
    path = next(k for k in tensors if k.startswith("optim/state/") and k.endswith("exp_avg"))
    assert all(torch.equal(tensors[k], v) for k, v in snapshot.capture(model, opt)[0].items())
    assert not torch.equal(tensors[path], want_tensors[path])


def test_a_body_is_compressed_only_when_that_pays_and_both_read_back():
    import os

    header = {"job": "j", "round": 1, "rank": 0, "world_size": 1, "step": 3}
    # compresses 16x (not past snapshotfile.MAX_RATIO: more is a crafted file's mark)
    alike = os.urandom(256 << 10) + bytes(15 * (256 << 10))
    noise = os.urandom(4 << 20)                      # does not compress at all
    for raw, codec in ((alike, "zstd"), (noise, "none")):
        data = snapshotfile.pack(header, raw)
        head, back = snapshotfile.unpack(data)
        assert (head["codec"], back) == (codec, raw)
    assert snapshotfile.unpack(snapshotfile.pack(header, noise, min_saving=0))[0]["codec"] == "zstd"
    # A codec this reader does not know is named, not guessed at.
    text = json.dumps({**header, "format": 1, "body_bytes": 1, "raw_bytes": 1,
                       "codec": "lz4"}).encode()
    odd = snapshotfile.MAGIC + len(text).to_bytes(4, "big") + text + b"x"
    odd += __import__("hashlib").sha256(odd).digest()
    with pytest.raises(SnapshotError, match="codec 'lz4', this reader knows zstd, none"):
        snapshotfile.unpack(odd)


def test_tensors_are_read_in_place_from_a_mapped_file_and_garbage_is_named(tmp_path):
    from safetensors.torch import save as st_save

    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b": torch.tensor(7, dtype=torch.int64), "c": torch.zeros(0, 4),
               "d": torch.ones(3, dtype=torch.bfloat16)}
    path = tmp_path / "t.safetensors"
    path.write_bytes(st_save(tensors))
    back = snapshot.tensors_of(snapshot.load_file(path))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    raw = bytearray(st_save(tensors))
    for garbage in (b"", b"\x05", bytes(raw[:-4]), b"\xff" * 8 + bytes(raw[8:]),
                    raw.replace(b'"F32"', b'"Q32"'), raw.replace(b"[2,3]", b"[2,-3]")):
        with pytest.raises(SnapshotError, match="its tensors do not parse"):
            snapshot.tensors_of(bytes(garbage))

"""Crafted restore points (docs/security.md, "Tier-0 snapshots"): a file whose checksum holds
but whose sizes, shapes or fields lie is a bad checkpoint -- SnapshotError / RestoreFailed,
which the worker reports as BAD_CHECKPOINT so the restore falls back to the next tier -- never
a 100 GB allocation, nor a KeyError or RuntimeError that the worker takes for a crash and
retries on the same file until the run fails."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import zstandard

from lazarus.core import snapshotfile
from lazarus.core.errors import CheckpointError, RestoreFailed
from lazarus.core.snapshotfile import SnapshotError
from lazarus.trainer.ckptfiles import MANIFEST
from lazarus.trainer.ckptlist import latest_checkpoint
from lazarus.trainer.ckptload import load_checkpoint
from lazarus.trainer.ckptsave import Checkpointer
from lazarus.trainer import snapshot
from tests.unit.tiny_model import trained, untrained

# More than any address space: an allocation of it fails wherever the test runs.
HUGE = 1 << 50


def frame_declaring(content: bytes, declared: int) -> bytes:
    """A real zstd frame of `content` whose header declares `declared` bytes of content."""
    real = zstandard.ZstdCompressor(level=1, write_checksum=False).compress(content)
    desc = real[4]
    single, dict_len = (desc >> 5) & 1, (0, 1, 2, 4)[desc & 3]
    size_len = (1 if single else 0, 2, 4, 8)[desc >> 6]
    window = real[5:5 + (0 if single else 1)]
    rest = 5 + len(window) + dict_len + size_len
    return (real[:4] + bytes([0xC0 | (desc & 0x3F)]) + window
            + real[5 + len(window):5 + len(window) + dict_len]
            + declared.to_bytes(8, "little") + real[rest:])


def crafted(body: bytes, raw_bytes: int, codec: str = "zstd") -> bytes:
    """A snapshot file as an attacker writes one: any header, any body, a correct digest."""
    head = json.dumps({"format": 1, "job": "j", "round": 1, "rank": 0, "world_size": 1,
                       "step": 1, "body_bytes": len(body), "raw_bytes": raw_bytes,
                       "codec": codec}).encode()
    start = snapshotfile.MAGIC + len(head).to_bytes(4, "big") + head + body
    return start + hashlib.sha256(start).digest()


def test_the_frame_is_what_the_test_says():
    assert zstandard.frame_content_size(frame_declaring(b"x" * 1000, HUGE)) == HUGE
    assert zstandard.ZstdDecompressor().decompress(frame_declaring(b"x" * 1000, 1000)) \
        == b"x" * 1000


@pytest.mark.parametrize("raw_bytes, declared, match", [
    (HUGE, HUGE, "more than 64x"),      # both lie alike: the ratio to the body gives it away
    (1000, HUGE, "declares"),           # the frame alone lies
    (HUGE, 1000, "more than 64x"),      # the header alone lies
])
def test_sizes_that_lie_are_refused_before_anything_is_allocated(raw_bytes, declared, match):
    data = crafted(frame_declaring(b"x" * 1000, declared), raw_bytes)
    with pytest.raises(SnapshotError, match=match):
        snapshotfile.unpack(data, "crafted")


@pytest.mark.parametrize("raw_bytes", [-1, 1000])
def test_a_frame_that_declares_no_size_is_refused_whatever_the_header_says(raw_bytes):
    """zstd's "size unknown" is -1: a header of raw_bytes -1 matched it, and the decompressor
    was then asked for a negative size (SystemError: taken for a crash, not a bad file)."""
    body = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(os.urandom(1000))
    assert zstandard.frame_content_size(body) == -1
    with pytest.raises(SnapshotError, match="not a size|declares no size"):
        snapshotfile.unpack(crafted(body, raw_bytes), "crafted")


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_a_negative_size_in_the_header_is_refused(codec):
    with pytest.raises(SnapshotError, match="'raw_bytes' is -5, not a size"):
        snapshotfile.read_header(crafted(b"body", -5, codec), "crafted")


def test_an_honest_file_of_zeros_within_the_ratio_still_reads():
    raw = bytes(1 << 16) + os.urandom(1 << 12)  # 94% zeros: compresses 15x, not absurdly
    data = snapshotfile.pack({"job": "j", "round": 1, "rank": 0, "world_size": 1, "step": 1},
                             raw, min_saving=0)
    assert bytes(snapshotfile.unpack(data)[1]) == raw


def _file(tensors, values, drop: str | None = None) -> bytes:
    header = {"job": "j", "round": 3, "rank": 0, "world_size": 1, "step": 17,
              "extra": {"step": 17}, "rng": snapshot.rng_state()}
    header.pop(drop or "", None)
    return snapshot.encode(tensors, values, header=header)


@pytest.fixture(scope="module")
def state():
    return snapshot.capture(*trained())


def _exp_avg(tensors) -> str:
    return next(k for k in tensors if k.startswith("optim/state/") and k.endswith("/exp_avg"))


@pytest.mark.parametrize("case", ["moment of another shape", "moment of no elements",
                                  "step as a vector", "no rng", "lr as text"])
@pytest.mark.parametrize("fresh", [True, False], ids=["restarted rank", "live optimizer"])
def test_crafted_state_is_a_bad_snapshot_not_a_crash(state, case, fresh):
    tensors, values = state
    moment = _exp_avg(tensors)
    lr = next(k for k in values if k.endswith("/lr"))
    data = {
        "moment of another shape": lambda: _file({**tensors, moment: torch.zeros(3)}, values),
        "moment of no elements": lambda: _file({**tensors, moment: torch.zeros(1 << 31, 0, 64)},
                                               values),
        "step as a vector": lambda: _file(
            {**tensors, moment.replace("exp_avg", "step"): torch.zeros(5)}, values),
        "no rng": lambda: _file(tensors, values, drop="rng"),
        "lr as text": lambda: _file(tensors, {**values, lr: "0.1; rm -rf"}),
    }[case]()
    model, opt = untrained() if fresh else trained()
    with pytest.raises(SnapshotError) as got:
        snapshot.restore(data, model, opt, rank=0, world_size=1, what="crafted")
    assert isinstance(got.value, CheckpointError)  # the worker's BAD_CHECKPOINT


def test_an_honest_snapshot_still_restores_into_a_fresh_optimizer(state):
    tensors, values = state
    model, opt = untrained()
    snapshot.restore(_file(tensors, values), model, opt, rank=0, world_size=1)
    model(torch.randint(0, 100, (2, 16))).float().mean().backward()
    opt.step()


@pytest.mark.parametrize("field", ["world_size", "extra"])
def test_a_manifest_missing_a_field_a_restore_reads_is_a_bad_checkpoint(tmp_path, field):
    model, opt = trained()
    saver = Checkpointer(tmp_path / "ckpt", keep_last=2)
    try:
        saver.save(1, model, opt, {"step": 1}, async_save=False)
        saver.wait()
    finally:
        saver.close()
    path = latest_checkpoint(tmp_path / "ckpt")
    manifest_file = Path(path) / MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest.pop(field)
    manifest_file.write_text(json.dumps(manifest))  # not in its own checksums
    with pytest.raises(RestoreFailed) as got:
        load_checkpoint(path, *trained())
    assert got.value.kind == "corrupt" and field in str(got.value)

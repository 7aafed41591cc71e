"""What one rank finds wrong in a checkpoint it cannot restore (ckptverify._inspect): the
kind tells the checkpoint's fault (corrupt) from what may be this node's view (missing,
unreadable); lazarus.daemon.restorefail compares the nodes'."""

from __future__ import annotations

import hashlib
import json

import pytest
from lazarus.trainer import ckptverify
from lazarus.trainer.ckptfiles import MANIFEST, OWNER, checkpoint_dir
from lazarus.trainer.ckptverify import verify_checkpoint

from lazarus.core.errors import RestoreFailed


def _committed(root, step=4, files=None):
    files = files or {"__0_0.distcp": b"shard zero", "__1_0.distcp": b"shard one"}
    d = checkpoint_dir(root, step)
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    (root / OWNER).write_text('{"job_id": "J"}\n')
    entries = [{"name": n, "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
               for n, b in sorted(files.items())]
    (d / MANIFEST).write_text(json.dumps({"format_version": 1, "step": step,
                                               "commit_seq": 1, "files": entries}))
    return d


def kind(path, rank=0, world=1):
    return ckptverify._inspect(path, rank, world)[1]


def test_a_sound_checkpoint_has_no_finding(tmp_path):
    assert kind(_committed(tmp_path)) is None


def test_a_flipped_byte_is_corrupt_and_named_first(tmp_path):
    d = _committed(tmp_path)
    (d / "__1_0.distcp").write_bytes(b"shard onf")
    assert kind(d) == ("corrupt", (f"__1_0.distcp fails its sha256 checksum (checkpoint {d} is "
                                   "corrupt)"))
    # Split across ranks, each hashes its share: rank 0 of 2 does not see the damage ...
    assert kind(d, 0, 2) is None and kind(d, 1, 2)[0] == "corrupt"
    # ... but every rank learns the first problem (the collective path raises it everywhere).
    with pytest.raises(RestoreFailed, match="__1_0.distcp fails its sha256") as e:
        verify_checkpoint(d)
    assert e.value.kind == "corrupt"


def test_missing_pieces_and_absent_storage_are_told_apart(tmp_path):
    d = _committed(tmp_path)
    (d / "__0_0.distcp").unlink()
    assert kind(d) == ("missing", f"__0_0.distcp is missing (checkpoint {d} is incomplete)")
    # A step deleted from a root that holds the job's checkpoints: gone, not unmounted.
    assert kind(checkpoint_dir(tmp_path, 8))[0] == "missing"
    # A root with no trace of any checkpoint (an empty dir where a mount should be) and a
    # root that is not there at all: the storage is not mounted here.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert kind(checkpoint_dir(empty, 4))[0] == "unreadable"
    assert kind(checkpoint_dir(tmp_path / "gone", 4)) == (
        "unreadable", (f"checkpoint root {tmp_path / 'gone'} is not there on this node (a "
                       "storage mount missing?)"))
    (d / MANIFEST).write_text("{not json")
    assert kind(d)[0] == "corrupt"

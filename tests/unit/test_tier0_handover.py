"""A rank hands its tier-0 snapshot file to its agent and keeps a descriptor of it: what the
rank does through that descriptor afterwards (the job's own code may) must not reach the copy
the agent keeps, maps and sends (lazarus.agent.tier0, docs/security.md "The job's own code")."""

from __future__ import annotations

import os
import threading

from lazarus.agent.tier0 import Tier0Store

DATA = os.urandom(1 << 20)


def store(tmp_path, limit_bytes: int = 64 << 20) -> Tier0Store:
    return Tier0Store(tmp_path / "t0", limit_bytes=limit_bytes)


def test_a_truncate_through_the_ranks_descriptor_leaves_the_kept_copy_whole(tmp_path):
    s = store(tmp_path)
    path = s.incoming / "r0.t0"
    with open(path, "wb") as theirs:      # the rank's descriptor, still open
        theirs.write(DATA)
        theirs.flush()
        copy = s.add_local("J", 0, 5, path)
        assert copy is not None
        theirs.truncate(0)                # SIGBUS for an agent mapping the file it took over
        theirs.seek(1 << 40)              # and then grown into a 1 TiB sparse file
        theirs.write(b"x")
    kept = s.path("J", 0, 5)
    assert kept is not None and kept.read_bytes() == DATA and copy.size == len(DATA)
    assert not path.exists()


def test_a_fifo_handed_over_is_refused_without_blocking(tmp_path):
    s = store(tmp_path)
    path = s.incoming / "r0.t0"
    os.mkfifo(path)
    result = []
    t = threading.Thread(target=lambda: result.append(s.add_local("J", 0, 5, path)),
                         daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the agent blocked opening a FIFO a rank handed over"
    assert result == [None] and s.path("J", 0, 5) is None


def test_a_sparse_file_larger_than_the_store_is_refused(tmp_path):
    s = store(tmp_path, limit_bytes=1 << 20)
    path = s.incoming / "r0.t0"
    with open(path, "wb") as f:
        f.truncate(1 << 40)
    assert s.add_local("J", 0, 5, path) is None
    assert s.path("J", 0, 5) is None and not path.exists()

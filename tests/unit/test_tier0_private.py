"""The tier-0 directory is the agent's user's alone (docs/security.md): one another local user
made first, opened, or replaced by a symlink is refused, and the shards in it are 0600
(lazarus.agent.tier0, lazarus.agent.tier0_agent). The attacker here is uid 65534 (nobody):
the tests run as root, which may give a directory away."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from lazarus.agent import tier0_agent
from lazarus.agent.tier0 import Tier0Store
from lazarus.agent.tier0_agent import Tier0, Tier0Options
from lazarus.core.errors import UserError
from lazarus.core.jobuser import JobUser

NOBODY = 65534


def agent_options(tmp_path, monkeypatch, **args) -> Tier0Options:
    """What `lazarus agent` makes of its flags, with the default directory moved from
    /dev/shm to `tmp_path/shm`."""
    monkeypatch.setattr(tier0_agent, "default_dir",
                        lambda workdir, node, job_uid=None: tmp_path / "shm" / f"lazarus-{os.geteuid()}"
                        / f"tag-{node}")
    parser = argparse.ArgumentParser()
    tier0_agent.add_tier0_args(parser)
    ns = parser.parse_args([])
    ns.node = "n0"
    monkeypatch.delenv(tier0_agent.KEY_ENV, raising=False)
    for k, v in args.items():
        setattr(ns, k, v)
    return tier0_agent.tier0_options(ns, tmp_path / "work")


def start(options: Tier0Options) -> Tier0:
    return Tier0(node="n0", host="127.0.0.1", options=options, lookup=lambda node: None)


def taken_first(tmp_path) -> Path:
    """The attacker's move: the predictable /dev/shm/lazarus-UID, made before the agent's."""
    planted = tmp_path / "shm" / f"lazarus-{os.geteuid()}"
    planted.mkdir(parents=True, mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    return planted


def test_the_default_directory_made_first_by_another_user_is_refused(tmp_path, monkeypatch):
    planted = taken_first(tmp_path)
    with pytest.raises(UserError, match=f"{planted}.* belongs to uid {NOBODY}"):
        start(agent_options(tmp_path, monkeypatch))
    assert list(planted.iterdir()) == []   # nothing of the agent's went in


def test_the_default_directory_as_a_symlink_to_the_attackers_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, NOBODY, NOBODY)
    (tmp_path / "shm").mkdir()
    (tmp_path / "shm" / f"lazarus-{os.geteuid()}").symlink_to(theirs)
    with pytest.raises(UserError, match="is a symlink"):
        start(agent_options(tmp_path, monkeypatch))
    assert list(theirs.iterdir()) == []


def test_the_default_directory_open_to_others_is_refused(tmp_path, monkeypatch):
    planted = tmp_path / "shm" / f"lazarus-{os.geteuid()}"
    planted.mkdir(parents=True)
    os.chmod(planted, 0o777)
    with pytest.raises(UserError, match="open to other users"):
        start(agent_options(tmp_path, monkeypatch))


def test_a_given_tier0_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    given = tmp_path / "given"
    given.mkdir(mode=0o700)
    os.chown(given, NOBODY, NOBODY)
    with pytest.raises(UserError, match=f"belongs to uid {NOBODY}"):
        start(agent_options(tmp_path, monkeypatch, tier0_dir=given))
    with pytest.raises(UserError, match=f"belongs to uid {NOBODY}"):
        Tier0Store(given, limit_bytes=1 << 20)


def test_a_given_tier0_dir_may_sit_in_a_shared_parent(tmp_path, monkeypatch):
    shared = tmp_path / "shm"
    shared.mkdir()
    os.chmod(shared, 0o1777)   # /dev/shm itself
    t0 = start(agent_options(tmp_path, monkeypatch, tier0_dir=shared / "mine"))
    try:
        assert stat.S_IMODE(os.lstat(t0.store.root).st_mode) == 0o700
    finally:
        t0.close()


def test_the_directories_are_0700_and_every_shard_0600(tmp_path, monkeypatch):
    t0 = start(agent_options(tmp_path, monkeypatch))
    store = t0.store
    try:
        for d in (store.root.parent, store.root, store.incoming):
            assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d
        shard = store.incoming / "s5.t0"
        shard.write_bytes(b"a rank's shard")
        os.chmod(shard, 0o644)   # as a rank leaves it
        local = store.add_local("j", 0, 5, shard)
        replica = store.add_replica("j", 1, 5, b"the peer's shard")
        for c in (local, replica):
            assert stat.S_IMODE(os.lstat(c.path).st_mode) == 0o600, c.path
        assert sorted(p.name for p in (store.root / "replica").iterdir()) == [replica.path.name]
    finally:
        t0.close()


def test_ranks_of_their_own_user_write_incoming_and_read_the_kept_copies(tmp_path):
    """--run-as: `incoming/` is the ranks' user's own; the store and its copies are the
    agent's, which the ranks' group passes through and reads (a round restores from them),
    never writes. (The ranks' user here is this process's: the modes and groups are what
    is checked; tests/e2e/test_run_as.py runs it with a second user.)"""
    user = JobUser("job", os.getuid(), os.getgid(), (), str(tmp_path))
    store = Tier0Store(tmp_path / "t0", limit_bytes=1 << 20, user=user)
    for d in (store.root, store.root / "local", store.root / "replica"):
        st = os.lstat(d)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o710, user.gid), d
    assert stat.S_IMODE(os.lstat(store.incoming).st_mode) == 0o700
    shard = store.incoming / "s5.t0"
    shard.write_bytes(b"a rank's shard")
    os.chmod(shard, 0o666)   # whatever the rank left
    local = store.add_local("j", 0, 5, shard)
    replica = store.add_replica("j", 1, 5, b"the peer's shard")
    for c in (local, replica):
        st = os.lstat(c.path)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, os.geteuid(),
                                                                     user.gid), c.path


def test_a_replica_is_never_written_through_a_planted_symlink(tmp_path):
    store = Tier0Store(tmp_path / "t0", limit_bytes=1 << 20)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    # where a copy used to be written first (the name is predictable)
    (store.root / "replica" / "j-r00001-s0000000005.t0.tmp").symlink_to(victim)
    store.add_replica("j", 1, 5, b"the peer's shard")
    assert victim.read_bytes() == b"precious"
    assert store.path("j", 1, 5).read_bytes() == b"the peer's shard"


def test_a_symlink_in_incoming_is_not_taken_over(tmp_path):
    store = Tier0Store(tmp_path / "t0", limit_bytes=1 << 20)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = store.incoming / "s5.t0"
    link.symlink_to(victim)
    assert store.add_local("j", 0, 5, link) is None
    assert store.path("j", 0, 5) is None


def test_a_hard_link_planted_in_incoming_is_not_taken_over(tmp_path):
    """Reported as a snapshot, a hard link to another file would be re-moded for the
    ranks' group to read; it is dropped, and the file keeps its mode."""
    store = Tier0Store(tmp_path / "t0", limit_bytes=1 << 20)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    os.link(victim, store.incoming / "s5.t0")
    assert store.add_local("j", 0, 5, store.incoming / "s5.t0") is None
    assert victim.read_bytes() == b"precious" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert store.path("j", 0, 5) is None

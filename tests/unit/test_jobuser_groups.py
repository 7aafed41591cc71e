"""The job user's groups (lazarus.core.jobuser.JobUser.resolve): its processes hold every group
it is in, so one in root's group, the agent's or a group that is root in all but name (docker,
sudo, disk, ...) would hand that to every job's code: refused in one line naming the group."""

from __future__ import annotations

import grp
import os
import pwd

import pytest

from lazarus.core import jobuser
from lazarus.core.errors import UserError
from lazarus.core.jobuser import JobUser

AGENT_GID = 4242
NAMES = {0: "root", 6: "disk", 999: "docker", 27: "sudo", 1500: "ml", AGENT_GID: "lazarus"}


@pytest.fixture
def other():
    """A user that is neither root nor this process's, with a group of its own."""
    return next(p for p in pwd.getpwall()
                if p.pw_uid not in (0, os.geteuid()) and p.pw_gid not in (0, os.getegid()))


@pytest.fixture(autouse=True)
def groups(monkeypatch):
    """The node's group names, and the agent's group, as a test needs them."""
    def getgrgid(g):
        if g not in NAMES:
            raise KeyError(g)
        return grp.struct_group((NAMES[g], "x", g, []))
    monkeypatch.setattr(jobuser.grp, "getgrgid", getgrgid)
    monkeypatch.setattr(jobuser.os, "getegid", lambda: AGENT_GID)


@pytest.mark.parametrize("extra, said", [
    ([0], "group root (0, root's)"),
    ([AGENT_GID], "group lazarus (4242, the agent's)"),
    ([999], "group docker (999)"),
    ([1500, 27], "group sudo (27)"),
    ([6], "group disk (6)"),
])
def test_a_job_user_in_a_privileged_supplementary_group_is_refused(other, monkeypatch, extra,
                                                                   said):
    monkeypatch.setattr(jobuser.os, "getgrouplist", lambda name, gid: [gid, *extra])
    with pytest.raises(UserError) as e:
        JobUser.resolve(other.pw_name)
    assert str(e.value) == (f"--run-as {other.pw_name!r}: it is in {said}, which every job's "
                            "code would hold; give the jobs a user in none of them")


def test_a_primary_group_that_is_root_in_all_but_name_is_refused():
    free = next(u for u in range(60001, 65000) if u not in {p.pw_uid for p in pwd.getpwall()})
    with pytest.raises(UserError, match=r"in group docker \(999\)"):
        JobUser.resolve(f"{free}:999")
    with pytest.raises(UserError, match="root's or the agent's"):
        JobUser.resolve(f"{free}:{AGENT_GID}")


def test_ordinary_groups_are_taken(other, monkeypatch):
    monkeypatch.setattr(jobuser.os, "getgrouplist", lambda name, gid: [gid, 1500, 31337])
    assert JobUser.resolve(other.pw_name).groups == (1500, 31337)

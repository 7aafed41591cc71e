"""The user ranks run as (lazarus.core.jobuser): a name that is no user, root, or the agent's
own user is a clear error naming the flag, never a traceback."""

from __future__ import annotations

import os
import pwd

import pytest

from lazarus.core.errors import UserError
from lazarus.core.jobuser import JobUser


def test_no_such_user():
    with pytest.raises(UserError, match=r"--run-as 'no-such-user-x': no such user.*job-user.sh"):
        JobUser.resolve("no-such-user-x")


def test_root_is_refused():
    with pytest.raises(UserError, match="that is root"):
        JobUser.resolve("root")
    with pytest.raises(UserError, match="that is root"):
        JobUser.resolve("0")


def test_the_agents_own_user_is_refused(monkeypatch):
    other = next(p for p in pwd.getpwall() if p.pw_uid != 0)
    # as an agent of that user would be (this test may run as root)
    monkeypatch.setattr(os, "geteuid", lambda: other.pw_uid)
    with pytest.raises(UserError, match="agent's own user"):
        JobUser.resolve(other.pw_name)


def test_another_user_is_taken_with_its_groups_and_login_environment():
    other = next(p for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid()))
    user = JobUser.resolve(other.pw_name)
    assert (user.uid, user.gid, user.home) == (other.pw_uid, other.pw_gid, other.pw_dir)
    assert user.gid not in user.groups
    assert user.popen_kwargs() == {"user": other.pw_uid, "group": other.pw_gid,
                                   "extra_groups": list(user.groups)}
    assert user.env() == {"HOME": other.pw_dir, "USER": other.pw_name, "LOGNAME": other.pw_name}

"""The user ranks run as (lazarus.core.jobuser): a name that is no user, root, or the agent's
own user is a clear error naming the flag, never a traceback."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

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
    other = next(p for p in pwd.getpwall()
                 if p.pw_uid not in (0, os.geteuid()) and p.pw_gid not in (0, os.getegid()))
    user = JobUser.resolve(other.pw_name)
    assert (user.uid, user.gid, user.home) == (other.pw_uid, other.pw_gid, other.pw_dir)
    assert user.gid not in user.groups
    assert {k: v for k, v in user.popen_kwargs().items() if k != "preexec_fn"} == {
        "user": other.pw_uid, "group": other.pw_gid,
        "extra_groups": list(user.groups) or [other.pw_gid]}  # never [] (CVE-2023-6507)
    assert user.env(Path("/unused")) == {"HOME": other.pw_dir, "USER": other.pw_name,
                                         "LOGNAME": other.pw_name}


def test_a_bare_uid_is_a_user_of_a_container_without_a_passwd_entry():
    """Kubernetes: `--run-as 10001:10001`, the pod's runAsUser and fsGroup, in no /etc/passwd."""
    free = next(u for u in range(60001, 65000) if u not in {p.pw_uid for p in pwd.getpwall()})
    user = JobUser.resolve(f"{free}:{free + 1}")
    assert (user.name, user.uid, user.gid, user.groups, user.home) == (str(free), free, free + 1,
                                                                     (), "")
    assert user.env(Path("/w/job"))["HOME"] == "/w/job"  # no home of its own: one of theirs
    assert JobUser.resolve(str(free)).gid == free
    with pytest.raises(UserError, match="UID:GID. in numbers|UID\\[:GID\\] in numbers"):
        JobUser.resolve("someone:wheel")
    with pytest.raises(UserError, match="root's or the agent's"):
        JobUser.resolve(f"{free}:0")


def test_a_directory_given_to_the_ranks_replaces_a_symlink_planted_there(tmp_path):
    """stacks/NODE/nccl lies in a directory the ranks own: what they plant at the name is
    neither followed (the agent would hand its target over) nor a reason not to start."""
    target = tmp_path / "agents-own"
    target.mkdir(mode=0o700)
    link = tmp_path / "nccl"
    link.symlink_to(target)
    user = JobUser("job", os.getuid(), os.getgid(), (), str(tmp_path))
    assert user.give(link) == link
    assert link.is_dir() and not link.is_symlink()
    assert oct(os.stat(target).st_mode & 0o777) == oct(0o700)
    a_file = tmp_path / "a-file-of-the-operators"
    a_file.write_text("kept")
    with pytest.raises(UserError, match="not a directory"):
        user.give(a_file)
    assert a_file.read_text() == "kept"

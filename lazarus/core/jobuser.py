"""The Unix user a node's ranks run as when it is not the agent's (`lazarus agent --run-as
USER`; docs/security.md, "Ranks under a user of their own").

The agent keeps its etcd credentials, its socket's directory and its tier-0 store as its own;
the job's code gets only what this module hands it: the directories it writes (rank logs,
exit notes, stacks and flight records, snapshots on their way in, its allowed root) as its
own, and the agent's directories above them to pass through (mode 0710, the job user's group),
never to list or write.
"""

from __future__ import annotations

import ctypes
import grp
import os
import pwd
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lazarus.core.errors import UserError
from lazarus.core.privatedir import set_dir

# What an agent that is not root needs to start, watch and stop ranks of another user
# (systemd: AmbientCapabilities=, deploy/systemd/lazarus-agent.service): become them (SETUID;
# SETGID, setgroups too), hand them directories (CHOWN), take over and re-mode the snapshots
# they write (FOWNER), read and rotate their files (DAC_OVERRIDE), stop them (KILL).
CAPABILITIES = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_KILL": 5,
                "CAP_SETGID": 6, "CAP_SETUID": 7}

# Groups whose members are root in all but name (docker's socket, sudo, raw disks, lxd's
# containers, the logs adm reads): a job user in one hands that to every job's code.
PRIVILEGED_GROUPS = ("docker", "sudo", "wheel", "adm", "disk", "lxd")

_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CAP_V3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


# Resolved here, not in the forked child (no dlopen or import between fork and exec).
_libc = ctypes.CDLL(None, use_errno=True)
_prctl, _capget, _capset = _libc.prctl, _libc.capget, _libc.capset


def _drop_inherited_capabilities() -> None:
    """In the child, between fork and exec (Popen's preexec_fn): an agent that is not root
    holds its capabilities as ambient ones, which would survive the change of user and the
    exec, and give job code CAP_SETUID. Cleared here, with the inheritable set (a program
    with file capabilities could take them from it): the exec then leaves none."""
    if _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:
        os._exit(126)
    header, data = _CapHeader(_CAP_V3, 0), (_CapData * 2)()
    if _capget(ctypes.byref(header), data) != 0:
        os._exit(126)
    for half in data:
        half.inheritable = 0
    if _capset(ctypes.byref(header), data) != 0:
        os._exit(126)


@dataclass(frozen=True, slots=True)
class JobUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary, as the user's login would have them
    home: str  # "" when the user is a bare uid, with no passwd entry

    @classmethod
    def resolve(cls, spec: str) -> JobUser:
        """The user of `spec`: a user name, or `UID[:GID]` (a container's user need not be
        in its /etc/passwd: then it has no home, and its group is GID, else UID). Checked:
        not root, not this process's own user, in no group of root's, the agent's or
        PRIVILEGED_GROUPS (primary or supplementary); UserError naming the problem otherwise."""
        uid_text, sep, gid_text = spec.partition(":")
        numeric = uid_text.isdigit() and (not sep or gid_text.isdigit())
        if sep and not numeric:
            raise UserError(f"--run-as {spec!r}: give a user name, or UID[:GID] in numbers")
        try:
            entry = pwd.getpwuid(int(uid_text)) if numeric else pwd.getpwnam(spec)
        except KeyError:
            if not numeric:
                raise UserError(f"--run-as {spec!r}: no such user on this node (create it "
                                f"first, e.g. `bash deploy/job-user.sh {spec}`)") from None
            entry = None
        uid = entry.pw_uid if entry else int(uid_text)
        if uid == 0:
            raise UserError(f"--run-as {spec!r}: that is root; ranks run as an unprivileged user")
        if uid == os.geteuid():
            raise UserError(f"--run-as {spec!r}: that is the agent's own user; name another "
                            f"one, or leave --run-as out")
        gid = (int(gid_text) if sep else uid) if entry is None else (
            int(gid_text) if sep else entry.pw_gid)
        if gid == 0 or gid == os.getegid():
            raise UserError(f"--run-as {spec!r}: its group ({gid}) is root's or the agent's; "
                            f"the ranks' group may pass the agent's directories")
        groups = () if entry is None else tuple(
            g for g in os.getgrouplist(entry.pw_name, gid) if g != gid)
        if why := _privileged(gid, groups):
            raise UserError(f"--run-as {spec!r}: it is in {why}, which every job's code "
                            "would hold; give the jobs a user in none of them")
        if entry is None:
            return cls(str(uid), uid, gid, (), "")
        return cls(entry.pw_name, uid, gid, groups, entry.pw_dir)

    def popen_kwargs(self) -> dict:
        """subprocess.Popen's arguments that start a process as this user, with no
        capability: all three ids, or the child keeps the agent's supplementary groups
        (root's, for a root agent)."""
        # Never an empty list: CPython 3.12.0 skipped setgroups() for one (CVE-2023-6507),
        # and the child kept the agent's groups.
        kwargs = {"user": self.uid, "group": self.gid,
                  "extra_groups": list(self.groups) or [self.gid]}
        if os.geteuid() != 0:  # root's change of user drops every capability by itself
            kwargs["preexec_fn"] = _drop_inherited_capabilities
        return kwargs

    def env(self, fallback_home: Path) -> dict[str, str]:
        """What a login of this user would have: caches (torch's, Triton's) go to its home,
        or to `fallback_home` (a directory of theirs) when it has none."""
        return {"HOME": self.home or str(fallback_home), "USER": self.name, "LOGNAME": self.name}

    def give(self, path: Path, *, in_theirs: bool = False) -> Path:
        """`path`, a directory of the agent's making (created when missing), made this user's
        own, mode 0700: the job writes there, and nobody else but the agent. `in_theirs`:
        its parent is this user's already (stacks/NODE/nccl), so whatever is at the name was
        planted there and is removed; elsewhere a symlink is removed, and anything else
        that is not a directory is a UserError."""
        path = Path(path)
        if path.is_symlink():  # never followed: the agent would hand over its target
            path.unlink()
        elif in_theirs and path.exists() and not path.is_dir():
            path.unlink()
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            pass  # not a directory: said next
        try:
            set_dir(path, 0o700, uid=self.uid, gid=self.gid)
        except OSError as e:
            raise UserError(f"{str(path)!r} is not a directory the agent can give to "
                            f"{self.name} ({e.strerror}); remove what is there") from None
        return path

    def can_pass(self, path: Path) -> bool:
        """Whether this user may reach what is inside `path` (every directory on the way
        passable, ACLs included): asked of the kernel, as that user."""
        try:
            return subprocess.run(["test", "-x", str(path)], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=30,
                                  **self.popen_kwargs()).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    def open_to(self, path: Path, what: str) -> None:
        """Make this user able to pass through `path`, a directory of this process's user
        (`what` names it in errors): when it is private (no group bits), its group becomes
        this user's with group x (0710); UserError when the user still cannot reach it."""
        path = Path(path)
        if self.can_pass(path):
            return
        st = os.stat(path)
        if st.st_uid == os.geteuid() and not st.st_mode & 0o070:
            set_dir(path, stat.S_IMODE(st.st_mode) | 0o010, gid=self.gid)
        if not self.can_pass(path):
            raise UserError(f"{what} {str(path)!r}: the ranks' user {self.name} cannot reach it "
                            f"(a directory on the way closed to it); give one it can reach")


def _privileged(gid: int, groups: tuple[int, ...]) -> str | None:
    """Which of the user's groups (its primary `gid` first) would give its processes more
    than a user's rights, said as "group NAME (GID)"; None when none would."""
    for g in (gid, *groups):
        try:
            name = grp.getgrgid(g).gr_name
        except KeyError:
            name = ""
        if g == 0 or g == os.getegid() or name in PRIVILEGED_GROUPS:
            whose = "root's" if g == 0 else "the agent's" if g == os.getegid() else name
            return f"group {name or g} ({g}, {whose})" if name != whose else f"group {name} ({g})"
    return None


def job_dir(workdir: Path) -> Path:
    """Where ranks of a user of their own may write by default (their allowed root, the
    preflight's checkpoint test): theirs, inside the agent's workdir they may only pass."""
    return Path(workdir) / "job"


def missing_capabilities() -> list[str]:
    """The capabilities --run-as needs that this process lacks (none for root)."""
    if os.geteuid() == 0:
        return []
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        eff = 0
    return [name for name, bit in CAPABILITIES.items() if not eff >> bit & 1]


def check_agent_may_switch() -> None:
    """UserError unless this process may start, watch and stop another user's ranks: root,
    or a user holding CAPABILITIES."""
    if missing := missing_capabilities():
        raise UserError(f"--run-as: the agent (uid {os.geteuid()}) starts ranks as another user "
                        f"only as root or with {', '.join(missing)} (systemd: "
                        f"AmbientCapabilities=, as deploy/systemd/lazarus-agent.service)")

"""Directories only this user may enter: the agent's workdir (its socket, the ranks' stacks and
exit notes, the record of running ranks) and the directory of the endpoint file (the API
token); and secret files only this user may read (the API token, etcd's password, the
tier-0 and rendezvous keys).

A directory another user made first (a shared /tmp), or one they may write to, would let them
plant a socket the ranks talk to, a symlink a write follows, or a note the agent believes. So
such a directory is refused with the reason, never repaired behind the operator's back.
"""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

from lazarus.core.errors import UserError


def private_dir(path: Path, what: str, *, others_may_read: bool = False,
                pass_gid: int | None = None) -> Path:
    """`path`, created mode 0700 (with its parents) when missing. UserError when it is a
    symlink, is not a directory, belongs to another user, or is open to group or others
    (with `others_may_read`, only writable by them). `pass_gid`: the group of the ranks'
    user (lazarus.core.jobuser), which may pass through it (0710) but not list or write it;
    a private directory is given to that group, one of another group with any group bit
    set is refused."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
        set_dir(path, 0o700)  # whatever the umask took away
    except FileExistsError:
        pass
    except OSError as e:
        raise UserError(f"{what} {str(path)!r} cannot be created ({e.strerror})") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UserError(f"{what} {str(path)!r} is a symlink; give the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} {str(path)!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise UserError(f"{what} {str(path)!r} belongs to uid {st.st_uid}, not to this user "
                        f"(uid {os.geteuid()}); give a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    if pass_gid is not None and not mode & 0o067:
        if st.st_gid != pass_gid or mode & 0o010 == 0:
            if mode & 0o070:
                raise UserError(f"{what} {str(path)!r} is open to group {st.st_gid}, not to "
                                f"the ranks' group {pass_gid} alone; `chmod 700 {path}`")
            set_dir(path, 0o710, gid=pass_gid)
        return path
    if mode & (0o022 if others_may_read else 0o077):
        allowed = "writable by" if others_may_read else "open to"
        raise UserError(f"{what} {str(path)!r} is {allowed} other users (mode {mode:04o}); "
                        f"`chmod 700 {path}`, or give another directory")
    return path


def set_dir(path: Path, mode: int, *, uid: int = -1, gid: int = -1) -> None:
    """Set the directory `path`'s mode (and owner, group) through a descriptor of it:
    never through a symlink swapped in (ELOOP, ENOTDIR: OSError), and without lchmod, which
    Linux lacks."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if uid != -1 or gid != -1:
            os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def read_secret_file(path: str | Path, what: str, secret: str) -> str:
    """The text of the secret file `path`, named `what` in messages; `secret` says what it
    holds ("a token").

    Like ssh with a private key, a file of this user's that group or others may read is
    refused (UserError): the secret would be theirs too. A file of another owner's is taken
    whatever its mode, as ssh takes it: a Kubernetes Secret mounted with fsGroup is root's and
    reaches this user through its group, and systemd's LoadCredential= file is root's with a
    read ACL for the service's user (its mode then shows the ACL's mask, 0440), or the user's
    own, 0400. The mode is the file's own, not a symlink's (a Secret's files are symlinks).
    OSError or UnicodeDecodeError when it cannot be read: the caller words that, naming its
    flag."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        text = f.read().decode()
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        raise UserError(f"{what} {str(path)!r} may be read by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}); {secret} must be its owner's alone: "
                        f"chmod 600 {shlex.quote(str(path))}")
    return text

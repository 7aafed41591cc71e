"""Where the CLI finds the daemon when told nothing: $LAZARUS_HOME/endpoint.json (default
~/.lazarus/endpoint.json), written by `lazarus daemon` and `lazarus up`, removed when they exit.

    {"addresses": ["127.0.0.1:7070", ...], "token": "...", "tls_ca": null, "pid": 1234}

Several addresses when several daemons serve (a leader and its standbys): the CLI tries them
in order. The file holds the API token, so it is created readable by its owner only, in a
directory nobody else may write to (lazarus.core.privatedir), under a name nobody could have
prepared (a new file, never a symlink followed), then renamed over the old one. The CLI reads
it only when it is a regular file of its own: one someone else planted could send the token
the CLI was given to their address.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.core.errors import UserError
from lazarus.core.privatedir import private_dir, read_secret_file


@dataclass(kw_only=True, slots=True)
class Endpoint:
    addresses: list[str] = field(default_factory=list)
    token: str | None = None
    tls_ca: str | None = None   # certificate the client trusts for the daemon (TLS on)
    pid: int = 0                # the process that wrote the file
    workdir: str | None = None  # a `lazarus up` cluster's: where `lazarus chaos` finds it


def default_path() -> Path:
    home = os.environ.get("LAZARUS_HOME")
    return (Path(home) if home else Path.home() / ".lazarus") / "endpoint.json"


def write(path: Path, endpoint: Endpoint) -> None:
    private_dir(path.parent, "the endpoint file's directory", others_may_read=True)
    doc = {"addresses": endpoint.addresses, "token": endpoint.token, "tls_ca": endpoint.tls_ca,
           "pid": endpoint.pid, "workdir": endpoint.workdir}
    # mkstemp: O_CREAT | O_EXCL (a symlink or file in the way fails it), mode 0600, a random name
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
            f.write("\n")
        os.replace(tmp, path)  # replaces whatever is at `path`, a symlink included, unfollowed
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(path: Path) -> Endpoint | None:
    """The endpoint in `path`, None when there is no file; UserError when it is garbage, or
    not a regular file of this user's."""
    try:
        # O_NONBLOCK: a FIFO in the way must not hang the CLI; a regular file ignores it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"endpoint file {str(path)!r} is unreadable ({e.strerror}; a symlink "
                        "is refused); delete it or give --address") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise UserError(f"endpoint file {str(path)!r} is not a file of this user's "
                            f"(owner uid {st.st_uid}); delete it or give --address")
        try:
            doc = json.loads(f.read().decode())
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise UserError(f"endpoint file {str(path)!r} is unreadable ({e}); delete it or "
                            "give --address") from None
    addresses = doc.get("addresses") if isinstance(doc, dict) else None
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        raise UserError(f"endpoint file {str(path)!r} has no address list; delete it or give "
                        "--address")
    token, ca, pid = doc.get("token"), doc.get("tls_ca"), doc.get("pid", 0)
    workdir = doc.get("workdir")
    return Endpoint(addresses=addresses, token=token if isinstance(token, str) else None,
                    tls_ca=ca if isinstance(ca, str) else None,
                    pid=pid if isinstance(pid, int) else 0,
                    workdir=workdir if isinstance(workdir, str) else None)


def remove_if_mine(path: Path, pid: int) -> None:
    """Delete the file unless another process has replaced it since."""
    try:
        current = read(path)
    except UserError:
        return
    if current is not None and current.pid == pid:
        path.unlink(missing_ok=True)


# A bearer token is the whole of the API's authentication: one short enough to guess (a
# placeholder like "t0ken" left in a file) would let anyone who reaches the port in.
MIN_TOKEN_CHARS = 16


def check_token(token: str, source: str) -> str:
    """`token` if it is long enough to be a secret; UserError naming `source` otherwise."""
    if len(token) < MIN_TOKEN_CHARS:
        raise UserError(f"{source} holds a token of {len(token)} characters; a token needs at "
                        f"least {MIN_TOKEN_CHARS} (make one with `openssl rand -hex 32`)")
    return token


def load_token(path: str | Path) -> str:
    """The bearer token in a token file (surrounding whitespace ignored); refused when group
    or others may read it (lazarus.core.privatedir.read_secret_file says which files)."""
    try:
        text = read_secret_file(path, "token file", "a token")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"token file {str(path)!r} is unreadable ({e})") from None
    token = text.strip()
    if not token:
        raise UserError(f"token file {str(path)!r} is empty")
    return check_token(token, f"token file {str(path)!r}")

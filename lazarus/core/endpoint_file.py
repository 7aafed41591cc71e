"""Where the CLI finds the daemon when told nothing: $LAZARUS_HOME/endpoint.json (default
~/.lazarus/endpoint.json), written by `lazarus daemon` and `lazarus up`, removed when they exit.

    {"addresses": ["127.0.0.1:7070", ...], "token": "...", "tls_ca": null, "pid": 1234}

Several addresses when several daemons serve (a leader and its standbys): the CLI tries them
in order. The file holds the API token, so it is created readable by its owner only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.core.errors import UserError


@dataclass(kw_only=True, slots=True)
class Endpoint:
    addresses: list[str] = field(default_factory=list)
    token: str | None = None
    tls_ca: str | None = None   # certificate the client trusts for the daemon (TLS on)
    pid: int = 0                # the process that wrote the file


def default_path() -> Path:
    home = os.environ.get("LAZARUS_HOME")
    return (Path(home) if home else Path.home() / ".lazarus") / "endpoint.json"


def write(path: Path, endpoint: Endpoint) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    doc = {"addresses": endpoint.addresses, "token": endpoint.token, "tls_ca": endpoint.tls_ca,
           "pid": endpoint.pid}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
        f.write("\n")
    os.replace(tmp, path)


def read(path: Path) -> Endpoint | None:
    """The endpoint in `path`, None when there is no file; UserError when it is garbage."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"endpoint file {str(path)!r} is unreadable ({e}); delete it or give "
                        "--address") from None
    addresses = doc.get("addresses") if isinstance(doc, dict) else None
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        raise UserError(f"endpoint file {str(path)!r} has no address list; delete it or give "
                        "--address")
    token, ca, pid = doc.get("token"), doc.get("tls_ca"), doc.get("pid", 0)
    return Endpoint(addresses=addresses, token=token if isinstance(token, str) else None,
                    tls_ca=ca if isinstance(ca, str) else None,
                    pid=pid if isinstance(pid, int) else 0)


def remove_if_mine(path: Path, pid: int) -> None:
    """Delete the file unless another process has replaced it since."""
    try:
        current = read(path)
    except UserError:
        return
    if current is not None and current.pid == pid:
        path.unlink(missing_ok=True)


def load_token(path: str | Path) -> str:
    """The bearer token in a token file (surrounding whitespace ignored)."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"token file {str(path)!r} is unreadable ({e})") from None
    if not token:
        raise UserError(f"token file {str(path)!r} is empty")
    return token

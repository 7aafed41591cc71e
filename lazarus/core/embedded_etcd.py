"""`--etcd embedded`: an etcd server run as our child, for a laptop, `lazarus up` and tests.

It is the real `etcd` binary (Debian package etcd-server), with its own data dir and free
ports, started with PR_SET_PDEATHSIG so that it never outlives the process that started it.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from lazarus.core.errors import UserError

INSTALL_HINT = ("the `etcd` binary was not found on PATH; install it with "
                "`apt-get install -y etcd-server` (or give --etcd HOST:PORT of a running etcd)")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the parent dies (Linux only)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        raise UserError(INSTALL_HINT)
    return found


class EmbeddedEtcd:
    """One etcd member on 127.0.0.1. `endpoint` is what clients pass as --etcd."""

    def __init__(self, data_dir: Path | None = None, *, client_port: int | None = None,
                 log_file: Path | None = None):
        self.binary = find_etcd_binary()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="lazarus-etcd-"))
        self.client_port = client_port or free_port()
        self.peer_port = free_port()
        self.log_file = log_file or (self.data_dir / "etcd.log")
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, *, timeout_s: float = 15.0) -> "EmbeddedEtcd":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [self.binary, "--name", "lazarus", "--data-dir", str(self.data_dir / "member"),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"lazarus={peer}",
               "--logger", "zap", "--log-outputs", str(self.log_file)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode}; "
                                   f"see {self.log_file}")
            if self._healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not listen on {self.endpoint} within {timeout_s:.0f} s")

    def _healthy(self) -> bool:
        """etcd answers /health with true once it has a leader and serves requests; an open
        port alone is not enough (a client then times out waiting for gRPC settings)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_port}/health",
                                        timeout=0.5) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


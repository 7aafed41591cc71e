"""`--etcd embedded`: an etcd server run as our child, for a laptop, `lazarus up` and tests.

It is the real `etcd` binary (Debian package etcd-server), with its own data dir and free
ports, started with PR_SET_PDEATHSIG so that it never outlives the process that started it.
`EmbeddedCluster` runs several such members as one cluster on loopback (the tests of failover
and quorum loss).

Every member compacts its history on its own and has an explicit space quota, the settings
docs/operations.md asks of an external etcd too:
- `--auto-compaction-mode periodic --auto-compaction-retention 5m`: revisions older than five
  minutes are dropped, so a run's rewrites of its status keys do not pile up. A watcher that
  was away longer re-lists (lazarus.core.etcd.Watch does).
- `--quota-backend-bytes` 2 GiB (etcd's own default, written down so that it is a decision):
  past it etcd raises the NOSPACE alarm and refuses writes until it is compacted,
  defragmented and the alarm disarmed.

Given an `EtcdSecurity` (lazarus.core.etcd_secure) it runs in secure mode: TLS with client
certificates for clients and peers, and etcd's authentication with our users and roles,
turned on at start. Either way /health and /metrics are served in plaintext on a loopback
port of their own (`metrics_url`): they tell nothing a key would.
"""

from __future__ import annotations

import ctypes
import json
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from lazarus.core import procstop
from lazarus.core.errors import UserError
from lazarus.core.etcd_auth import EtcdAuth

if TYPE_CHECKING:
    from lazarus.core.etcd_secure import EtcdSecurity

INSTALL_HINT = ("the `etcd` binary was not found on PATH; install it with "
                "`apt-get install -y etcd-server` (or give --etcd HOST:PORT of a running etcd)")

QUOTA_BYTES = 2 << 30
COMPACTION_RETENTION = "5m"

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the parent dies (Linux only)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports this process handed out: a port is only checked free, not held, so two calls in a row
# must not return the same one.
_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range. A server we stop and start
    again on the same port (etcd in an outage, the API of a daemon started anew) must find it
    free, and outgoing connections take their local ports from that range -- a client retrying
    a stopped server on loopback can even connect to itself on the server's port (an e2e
    etcd restart failed with "address already in use" that way)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200 if low > 11000 else 0):
        port = rng.randrange(10000, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        raise UserError(INSTALL_HINT)
    return found


class EmbeddedEtcd:
    """One etcd member, serving clients on `host` (127.0.0.1 unless given: the local cluster
    in network namespaces serves its nodes on a bridge address). `endpoint` is what clients
    pass as --etcd.

    Alone by default; a member of a cluster when `initial_cluster` ("name=peer-url,...") is
    given (EmbeddedCluster builds that). `quota_bytes` is the NOSPACE threshold.
    `compaction_retention`: the history it keeps (an etcd duration); shorter only where time
    runs faster (the fleet simulator's compressed day). `secure`: secure mode, with
    certificates and users of its own in data_dir/pki, authentication turned on by `start()`;
    `security`: those of the cluster it is a member of (whose `start` turns it on).
    `auth_token_ttl_s`: how long etcd keeps an idle client's token (etcd's default: 300 s);
    shorter only in the tests of clients that outlive their token.
    """

    def __init__(self, data_dir: Path | None = None, *, client_port: int | None = None,
                 log_file: Path | None = None, name: str = "lazarus",
                 peer_port: int | None = None, initial_cluster: str | None = None,
                 quota_bytes: int = QUOTA_BYTES, host: str = "127.0.0.1",
                 compaction_retention: str = COMPACTION_RETENTION,
                 secure: bool = False, security: EtcdSecurity | None = None,
                 auth_token_ttl_s: int | None = None):
        self.binary = find_etcd_binary()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="lazarus-etcd-"))
        self.name = name
        if secure and security is None:
            # lazily: only secure mode loads cryptography and the etcd client
            from lazarus.core.etcd_secure import EtcdSecurity
            security = EtcdSecurity(self.data_dir / "pki")
        self.security = security
        self.server_cert = security.server_cert(name) if security is not None else None
        self.host = host
        self.client_port = client_port or free_port()
        self.metrics_port = free_port()
        self.peer_port = peer_port or free_port()
        # Ports chosen here, for a member of its own: another process may take one between
        # free_port()'s check and etcd's bind; a first start may then choose again.
        self._ports_mine = client_port is None and peer_port is None and initial_cluster is None
        self._started = False
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self.quota_bytes = quota_bytes
        self.compaction_retention = compaction_retention
        self.auth_token_ttl_s = auth_token_ttl_s
        self.log_file = log_file or (self.data_dir / "etcd.log")
        self.proc: subprocess.Popen | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.security is not None else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.peer_port}"

    @property
    def metrics_url(self) -> str:
        """Prometheus metrics (plaintext, loopback)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def auth(self, user: str | None):
        """A client's access to this etcd as `user` (lazarus.core.etcd_rbac): plaintext and
        no user unless in secure mode -- and `insecure` when it was started plaintext on an
        address other than loopback, which its starter chose (a test's private bridge)."""
        if self.security is not None:
            return self.security.auth(user)
        return EtcdAuth(insecure=not self.host.startswith("127."))

    def launch(self) -> None:
        """Start the process without waiting: a cluster member is healthy only once a
        majority of its peers runs too."""
        assert not self.running, f"etcd {self.name} already runs (pid {self.proc.pid})"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        client = f"{self.scheme}://{self.endpoint}"
        cmd = [self.binary, "--name", self.name, "--data-dir", str(self.data_dir / "member"),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}",
               "--listen-peer-urls", self.peer_url,
               "--initial-advertise-peer-urls", self.peer_url,
               "--initial-cluster", self.initial_cluster,
               "--auto-compaction-mode", "periodic",
               "--auto-compaction-retention", self.compaction_retention,
               "--quota-backend-bytes", str(self.quota_bytes),
               "--logger", "zap", "--log-outputs", str(self.log_file)]
        if self.auth_token_ttl_s is not None:
            cmd += ["--auth-token-ttl", str(self.auth_token_ttl_s)]
        if self.server_cert is not None:
            cert, key, ca = map(str, (self.server_cert.cert, self.server_cert.key,
                                      self.server_cert.ca))
            cmd += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca,
                    "--client-cert-auth",
                    "--peer-cert-file", cert, "--peer-key-file", key,
                    "--peer-trusted-ca-file", ca, "--peer-client-cert-auth"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def wait_healthy(self, *, timeout_s: float = 15.0) -> None:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode}; "
                                   f"see {self.log_file}")
            if self._healthy():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not listen on {self.endpoint} within {timeout_s:.0f} s")

    def start(self, *, timeout_s: float = 15.0) -> "EmbeddedEtcd":
        for attempt in range(3):
            self.launch()
            try:
                self.wait_healthy(timeout_s=timeout_s)
                break
            except RuntimeError:
                if not (attempt < 2 and self._ports_mine and not self._started
                        and self._port_taken()):
                    raise
            # Nothing was served yet: the member's data is ours to drop with its ports.
            shutil.rmtree(self.data_dir / "member", ignore_errors=True)
            self.client_port, self.metrics_port, self.peer_port = (free_port() for _ in range(3))
            self.initial_cluster = f"{self.name}={self.peer_url}"
        self._started = True
        if self.security is not None and not self.security.enabled:
            self.security.enable(self.endpoint)
        return self

    def _port_taken(self) -> bool:
        try:
            return "address already in use" in self.log_file.read_text(errors="replace")
        except OSError:
            return False

    def _healthy(self) -> bool:
        """etcd answers /health with true once it has a leader and serves requests; an open
        port alone is not enough (a client then times out waiting for gRPC settings)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health",
                                        timeout=0.5) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crashed machine would stop; the data dir stays for a restart."""
        if self.running:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.running:
            procstop.stop(self.proc, 10)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


class EmbeddedCluster:
    """`size` etcd members on loopback forming one cluster; `endpoint` lists them all
    ("a:1,b:2,c:3"), as --etcd takes them. `secure`: in secure mode, one CA and one set of
    users for all members (in data_dir/pki)."""

    def __init__(self, data_dir: Path | None = None, *, size: int = 3,
                 quota_bytes: int = QUOTA_BYTES, secure: bool = False):
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="lazarus-etcd-cluster-"))
        self.security = None
        if secure:
            # lazily: only secure mode loads cryptography and the etcd client
            from lazarus.core.etcd_secure import EtcdSecurity
            self.security = EtcdSecurity(self.data_dir / "pki")
        scheme = "https" if secure else "http"
        names = [f"m{i}" for i in range(size)]
        peers = {name: free_port() for name in names}
        initial = ",".join(f"{n}={scheme}://127.0.0.1:{p}" for n, p in peers.items())
        self.members = [EmbeddedEtcd(self.data_dir / n, name=n, peer_port=peers[n],
                                     initial_cluster=initial, quota_bytes=quota_bytes,
                                     security=self.security)
                        for n in names]

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def auth(self, user: str | None):
        return self.members[0].auth(user)

    def start(self, *, timeout_s: float = 20.0) -> "EmbeddedCluster":
        for m in self.members:
            m.launch()
        for m in self.members:
            m.wait_healthy(timeout_s=timeout_s)
        if self.security is not None and not self.security.enabled:
            self.security.enable(self.endpoint)
        return self

    def restart(self, index: int, *, timeout_s: float = 20.0) -> None:
        """Start a stopped member again on its data dir; healthy once it has a leader."""
        member = self.members[index]
        assert not member.running, f"member {member.name} runs"
        member.launch()
        member.wait_healthy(timeout_s=timeout_s)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()

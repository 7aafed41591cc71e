"""`lazarus daemon`: the reconcile loop around decide(), plus leader election.

    observe (the cached view at revision R) -> decide(now, view) -> apply (one fenced txn)

The view comes from an informer (lazarus.daemon.cache): etcd is listed once, and a watch on
our key root keeps the copy current; a change only wakes the loop, and passes woken by changes
are rate-limited, so a burst of writes costs a few passes. A periodic tick covers timeouts.
The daemon holds no state that is not in etcd, so a standby that wins the election simply
carries on. (Its data dir keeps only the history that retention moved out of etcd: nothing
decide() reads.)
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lazarus.core import endpoint_file, jobspec, logs, settings
from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import EmbeddedEtcd
from lazarus.core.errors import UserError
from lazarus.core.etcd_auth import refuse_plaintext
from lazarus.core.records import Keys, writer_id
from lazarus.daemon import api, executor, telemetry
from lazarus.daemon.compaction import COMPACT_EVERY_S, KEEP_HISTORY_FACTOR, Compactor
from lazarus.daemon.decide import decide
from lazarus.daemon.etcdhealth import EtcdHealth
from lazarus.daemon.history import History
from lazarus.daemon.leader import Leadership
from lazarus.daemon.retention import Pruner, Retention
from lazarus.daemon.telemetry import TelemetryConfig
from lazarus.daemon.view import LiveView

log = logging.getLogger("lazarus.daemon")


# Passes woken by changes are at least this far apart: when every agent reports at once (a
# new round), the changes gather into a few passes instead of one pass each.
MIN_PASS_S = 0.2
# How long `step()` waits for the cache to catch up with etcd (a change outside our root never
# arrives through our watch, so the wait must end), and how long a pass waits to see the
# daemon's own last write come back through the watch before it gives up its turn.
CATCH_UP_S = 0.5
# How often a paced wait looks at the stop flag (it ends at once when awaited reports land).
PACE_SLICE_S = 0.05
OWN_WRITE_S = 1.0


class Daemon:
    """`tick_s` bounds how late a timeout is noticed; `lease_ttl_s` is how long a dead leader
    blocks its standbys (the failover time). `min_pass_s`: passes woken by changes are at
    least this far apart (the tick, the daemon's own writes and the reports a decision
    awaits are not held back), so a decision may come up to that much later than the change
    it answers. `on_pass(is_leader)` runs after every pass of the loop (telemetry); etcd
    being unreachable there is retried like in the pass itself. `history`: where the leader
    keeps what it prunes from etcd past `retention` (lazarus.daemon.retention); None:
    nothing is pruned.

    Every daemon, leader or standby, keeps `views`: its informer's copy of etcd (listed once,
    then kept current by a watch; lazarus.daemon.cache) parsed into views, which its passes
    decide from and its API and telemetry read."""

    def __init__(self, etcd: E.Etcd, keys: Keys, *, lease_ttl_s: int = settings.LEASE_TTL_S, tick_s: float = 0.5,
                 min_pass_s: float = MIN_PASS_S,
                 on_pass: Callable[[bool], None] | None = None,
                 compact_every_s: float = COMPACT_EVERY_S, history: History | None = None,
                 retention: Retention | None = None):
        self.etcd = etcd
        self.keys = keys
        self.tick_s = tick_s
        self.min_pass_s = min_pass_s
        self.on_pass = on_pass
        self.writer = writer_id()
        self.leadership = Leadership(etcd, keys, ttl_s=lease_ttl_s, identity={
            "id": self.writer, "pid": os.getpid(), "host": socket.gethostname()})
        self.wake = threading.Event()
        self.views = LiveView(etcd, keys, on_change=self._changed)
        # The status keys the last decision waits for (Decision.awaiting), and whether they
        # have all been written since: then the next pass is not held back by min_pass_s.
        self._awaiting: set[str] = set()
        self._answered_event = threading.Event()
        self._await_lock = threading.Lock()
        self.passes = 0          # passes that decided (for tests and benchmarks)
        self._written = 0        # the revision of our last write
        self._again = False      # our own write changed the state: the next pass at once
        self._last_reason = ""
        self._ignored_logged: set[str] = set()
        # etcd's own health (outages, alarms: no evictions meanwhile) and its compaction, up
        # to what our informer has consumed
        self.etcd_health = EtcdHealth(etcd, keys, writer=self.writer)
        self.compactor = Compactor(etcd, root=keys.root, every_s=compact_every_s,
                                   consumed=lambda: self.views.informer.revision)
        self.pruner = Pruner(etcd, keys, history, retention)

    def step(self) -> None:
        """One pass over etcd's state as of the call (what tests and tools call): the cache
        catches up with etcd's current revision first."""
        self._pass(catch_up_s=CATCH_UP_S)

    def _pass(self, *, catch_up_s: float) -> None:
        informer = self.views.informer
        informer.start()
        # One read of etcd per pass, as when a pass read a snapshot: an outage shows here,
        # and the leader holds evictions through it (EtcdHealth).
        current = self.etcd.revision(self.keys.root)
        if catch_up_s:
            informer.wait_for(current, catch_up_s)
        if not informer.wait_for(self._written, OWN_WRITE_S):
            # Deciding on a view without our own last write could take a decision twice
            # (executor.apply): the watch will bring it, and wake us.
            log.debug("the cache is not yet at our write of revision %d", self._written)
            return
        if not self.leadership.is_leader:
            if not self.leadership.campaign():
                self._log_ignored(self.views.current())  # a standby's API reads it: parsed
                return
            self._last_reason = ""
        view = self.views.current()
        self.passes += 1
        self._log_ignored(view)
        now = time.time()
        decision = decide(now, view)
        self._await(decision.awaiting)
        if decision.reason != self._last_reason:
            log.info("%s", decision.reason)
            self._last_reason = decision.reason
        if not decision.actions or self.etcd_health.hold(decision, view):
            return
        written = executor.apply(self.etcd, self.keys, self.leadership, decision, view, now=now,
                                 writer=self.writer)
        if written is not None:
            self._written = max(self._written, written)
            self._again = True
            self.wake.set()  # our own write changed the state: look again at once
        elif self.leadership.check():
            self.wake.set()  # the view was stale; the watch brings a newer one

    def _await(self, nodes: tuple[str, ...]) -> None:
        with self._await_lock:
            self._awaiting = {self.keys.nodestatus_key(n) for n in nodes}
            self._answered_event.clear()

    def _changed(self, keys) -> None:
        """The informer's callback (etcd's thread): O(changed keys) while a decision waits
        for some, O(1) otherwise, so a burst of 4,096 reports costs no more than before."""
        with self._await_lock:
            if self._awaiting:
                self._awaiting.difference_update(keys)
                if not self._awaiting:
                    self._answered_event.set()
        self.wake.set()

    def _pace(self, stop: threading.Event, not_before: float) -> bool:
        """Wait until `not_before` or until the awaited reports are in; True when stopped."""
        while (left := not_before - time.monotonic()) > 0:
            if self._answered_event.wait(min(left, PACE_SLICE_S)):
                break
            if stop.is_set():
                return True
        with self._await_lock:
            self._answered_event.clear()
        return stop.is_set()

    def _log_ignored(self, view) -> None:
        """Name each record the view leaves out once, and again if it heals and breaks
        again. O(ignored keys) a pass."""
        logged = self._ignored_logged
        for key, why in view.ignored.items():
            if key not in logged:
                logged.add(key)
                log.warning("ignoring %s", why if why.startswith(key) else f"{key}: {why}")
        if len(logged) > len(view.ignored):
            logged.intersection_update(view.ignored)

    def run(self, stop: threading.Event) -> None:
        backoff = E.Backoff(initial_s=0.1, max_s=2.0)
        not_before = 0.0
        self._again = True  # the first pass at once: it lists etcd
        self.wake.set()
        while not stop.is_set():
            woken = self.wake.wait(self.tick_s)
            if woken and not self._again:
                # A change woke us: let the changes that follow it gather into this pass, but
                # not past the reports a decision waits for: those are what it decides on.
                if self._pace(stop, not_before):
                    break
            self.wake.clear()
            self._again = False
            not_before = time.monotonic() + self.min_pass_s
            try:
                self.etcd_health.poll(self.leadership)  # reads: works under NOSPACE too
                self._pass(catch_up_s=0.0)
                if self.on_pass is not None:
                    self.on_pass(self.leadership.is_leader)
                self.compactor.tick(leading=self.leadership.is_leader)
                self.pruner.tick(self.leadership)
                self.etcd_health.ok()
                backoff.reset()
            except E.EtcdUnavailable as e:
                self.etcd_health.failed(e)
                stop.wait(backoff.next())
        self.views.stop()
        self.leadership.resign()


def _env_token(name: str) -> str | None:
    value = os.environ.get(name)
    return endpoint_file.check_token(value, f"${name}") if value else None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lazarus daemon", description=__doc__.splitlines()[0])
    settings.add_etcd_args(p, etcd_help="etcd endpoint HOST:PORT, several members "
                                        "HOST:PORT,HOST:PORT,..., or 'embedded' to start one "
                                        "(default %(default)s)",
                           lease_ttl=settings.LEASE_TTL_S, lease_help="leader lease TTL in seconds",
                           insecure_api=True)
    p.add_argument("--job", help="submit this job file (TOML) at start")
    p.add_argument("--data-dir", type=Path,
                   help="the daemon's data: history/ (what the leader prunes from etcd; share "
                        "the dir between a leader and its standbys to keep one history) and, "
                        "with --etcd embedded, etcd's data (default: the embedded etcd's temp "
                        "dir, else $LAZARUS_HOME/daemon or ~/.lazarus/daemon)")
    p.add_argument("--retention", default="", metavar="KIND=N,...",
                   help="what etcd keeps before the leader moves it to the history: "
                        "events=N,rounds=N,checkpoints=N (newest kept), days=D (older "
                        "events and checkpoint records go) (default: events=1000,rounds=50,"
                        "checkpoints=50,days=7)")
    p.add_argument("--compact-every", type=float, default=COMPACT_EVERY_S, metavar="SECONDS",
                   help="the leader compacts etcd's history this often, keeping the last "
                        f"{KEEP_HISTORY_FACTOR:g}x that of it; 0: never, when etcd compacts "
                        "itself (default %(default)s)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--api", default="127.0.0.1:7070",
                   help="serve the gRPC API on HOST:PORT (port 0: any free port; 'off': no "
                        "API) (default %(default)s)")
    p.add_argument("--token-file", help="admin bearer token: may call every RPC (default: "
                   "env LAZARUS_TOKEN, else a random one, written to the endpoint file)")
    p.add_argument("--read-token-file", help="read-only bearer token: status, nodes, events "
                   "and checkpoints, no commands (default: env LAZARUS_READ_TOKEN, else none)")
    p.add_argument("--submit-token-file", help="submit bearer token, the users': what the "
                   "read-only one may, and submit and cancel jobs (`lazarus run`, `lazarus "
                   "submit`); no operator commands (default: env LAZARUS_SUBMIT_TOKEN, else "
                   "none)")
    p.add_argument("--tls-cert", help="serve the API over TLS with this certificate (PEM)")
    p.add_argument("--tls-key", help="private key of --tls-cert (PEM)")
    p.add_argument("--tls-client-ca", help="mutual TLS: clients need a certificate this CA "
                   "signed")
    p.add_argument("--endpoint-file", default=None,
                   help="where to leave the API address and token for the CLI (default "
                        "$LAZARUS_HOME/endpoint.json or ~/.lazarus/endpoint.json; '' for none)")
    p.add_argument("--otlp-endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                   help="export traces and metrics over OTLP/HTTP to this collector base URL, "
                        "e.g. http://collector:4318 (default: env OTEL_EXPORTER_OTLP_ENDPOINT, "
                        "else none)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: any "
                        "free port; default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the Prometheus endpoint; 0.0.0.0 for a remote scraper "
                        "(default %(default)s)")
    args = p.parse_args(argv)
    if args.api != "off" and args.tls_cert is None:
        refuse_plaintext(f"--api {args.api}", args.api.rpartition(":")[0],
                         insecure=args.insecure, fix="give --tls-cert and --tls-key")
    auth = settings.etcd_auth(args)
    logs.setup(args.log_level, "daemon")
    settings.check_lease_ttl(args.lease_ttl)
    if not args.compact_every >= 0:
        raise UserError("--compact-every must be 0 (never) or a number of seconds, got "
                        f"{args.compact_every}")
    retention = Retention.parse(args.retention)
    job = jobspec.load(args.job) if args.job else None
    keys = Keys(args.root)
    token = (endpoint_file.load_token(args.token_file) if args.token_file
             else _env_token("LAZARUS_TOKEN"))
    read_token = (endpoint_file.load_token(args.read_token_file) if args.read_token_file
                  else _env_token("LAZARUS_READ_TOKEN"))
    submit_token = (endpoint_file.load_token(args.submit_token_file) if args.submit_token_file
                    else _env_token("LAZARUS_SUBMIT_TOKEN"))
    ep_path = endpoint_file.default_path() if args.endpoint_file is None else (
        Path(args.endpoint_file) if args.endpoint_file else None)
    if args.api != "off" and token is None:
        if ep_path is None:
            raise UserError("give --token-file or LAZARUS_TOKEN when --endpoint-file is ''")
        token = secrets.token_urlsafe(24)  # only the endpoint file's owner can read it

    embedded = None
    endpoint = args.etcd
    if endpoint == "embedded":
        embedded = EmbeddedEtcd(args.data_dir).start()
        endpoint = embedded.endpoint
        log.info("embedded etcd at %s", endpoint)
    # History belongs with the etcd it came from: a throwaway embedded etcd, a throwaway one.
    history = History.at(args.data_dir or (embedded.data_dir if embedded else
                                           endpoint_file.default_path().parent / "daemon"), keys)
    etcd = E.Etcd(endpoint, auth=auth)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = None
    tel = None
    try:
        if job is not None:
            E.retry(lambda: etcd.put(keys.job, job.to_json()), deadline_s=30)
            log.info("submitted job %s (%s)", job.name, job.id)
        daemon = Daemon(etcd, keys, lease_ttl_s=args.lease_ttl, compact_every_s=args.compact_every,
                        history=history, retention=retention)
        tel_cfg = TelemetryConfig(otlp_endpoint=args.otlp_endpoint or None,
                                  metrics_host=args.metrics_host, metrics_port=args.metrics_port)
        if tel_cfg.enabled:
            tel = telemetry.start(tel_cfg, etcd, keys, served_by=daemon.writer, history=history,
                                  views=daemon.views)
            daemon.on_pass = tel.on_pass
            if tel.metrics_port is not None:
                log.info("Prometheus metrics on http://%s:%d/metrics", args.metrics_host,
                         tel.metrics_port)
            if tel_cfg.otlp_endpoint:
                log.info("OTLP export to %s", tel_cfg.otlp_endpoint)
        if args.api != "off":
            server, port = api.serve(etcd, keys, address=args.api, token=token,
                                     read_token=read_token, submit_token=submit_token,
                                     tls_cert=args.tls_cert, tls_key=args.tls_key,
                                     client_ca=args.tls_client_ca, served_by=daemon.writer,
                                     history=history, views=daemon.views)
            address = _advertised(args.api, port)
            daemon.leadership.identity["api"] = address  # GetRunHealth names the leader's API
            log.info("API on %s%s", address, " (TLS)" if args.tls_cert else "")
            if ep_path is not None:
                endpoint_file.write(ep_path, endpoint_file.Endpoint(
                    addresses=[address], token=token, pid=os.getpid(),
                    tls_ca=str(Path(args.tls_cert).resolve()) if args.tls_cert else None))
        daemon.run(stop)
    finally:
        if tel is not None:
            tel.shutdown()
        if server is not None:
            server.stop(grace=1.0).wait()
            if ep_path is not None:
                endpoint_file.remove_if_mine(ep_path, os.getpid())
        etcd.close()
        if embedded is not None:
            embedded.cleanup()
    return 0


def _advertised(listen: str, port: int) -> str:
    """The address clients dial: the listen host, or this host's name for a wildcard."""
    host = listen.rpartition(":")[0]
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"

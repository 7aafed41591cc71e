"""`lazarus fleet`: the control plane under a simulated fleet, measured.

A real etcd (embedded, or --etcd), the real `lazarus daemon` as a child process, and N
simulated nodes of `nproc` ranks (lazarus.sim.fleet) training one job. In phases:

  steady   no faults for a while: the daemon's CPU (cores) and RSS, etcd's writes/s
  faults   worker crashes and node losses, one at a time: fault seen -> the daemon's next
           round committed (the decision), and fault -> round / -> running again
  day      a compressed day: status writes and etcd's compaction sped up by --compression,
           faults every --fault-every seconds; etcd's database size sampled throughout

and a table of the figures against the targets (docs/architecture.md, "Write budget").
"""

from __future__ import annotations

import argparse
import logging
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lazarus.core import etcd as E
from lazarus.core import jobspec, logs, procstop, settings
from lazarus.core.embedded_etcd import (
    COMPACTION_RETENTION,
    EmbeddedEtcd,
    die_with_parent,
)
from lazarus.core.errors import UserError
from lazarus.core.etcd_auth import EtcdAuth
from lazarus.core.records import Keys
from lazarus.daemon.compaction import COMPACT_EVERY_S
from lazarus.sim.fleet import Fault, Fleet, FleetConfig, describe

log = logging.getLogger("lazarus.fleet")

# The targets at 4,096 nodes (issue 11): decision < 1 s, daemon < 1 core, etcd's
# database flat and under 200 MB over the simulated day.
TARGET_DECISION_S = 1.0
TARGET_DAEMON_CORES = 1.0
TARGET_DB_BYTES = 200 * 10**6
BUDGET_WRITES_PER_NODE_S = 0.1


def job_for(config: FleetConfig) -> jobspec.JobSpec:
    """One job over every active node: no shrinking (spares replace lost nodes), restarts
    without end, and time for thousands of simulated agents to start a round."""
    n = config.nodes
    return jobspec.from_dict({
        "job": {"name": "fleet", "nodes": n, "min_nodes": n, "nproc_per_node": config.nproc,
                "max_restarts": 1_000_000, "rendezvous_timeout_s": 600},
        "train": {"steps": 10**9, "model": {"name": "tiny"},
                  "data": {"global_batch": n * config.nproc}}}, source="fleet job")


class ControlPlane:
    """etcd (embedded in `workdir` unless `endpoint` names one) and `lazarus daemon` as a child
    process against it, logging to workdir/daemon.log."""

    def __init__(self, workdir: Path, *, endpoint: str | None = None,
                 auth: EtcdAuth | None = None, daemon_args: list[str] | None = None,
                 compaction_retention: str = COMPACTION_RETENTION):
        self.workdir = workdir
        self.embedded = None if endpoint else EmbeddedEtcd(
            workdir / "etcd", compaction_retention=compaction_retention)
        self.endpoint = endpoint
        self.auth = auth or EtcdAuth()
        self.daemon_args = [*self.auth.args(), *(daemon_args or [])]
        self.daemon: subprocess.Popen | None = None
        self.daemon_log = workdir / "daemon.log"

    def start(self) -> ControlPlane:
        if self.embedded is not None:
            self.endpoint = self.embedded.start().endpoint
        with open(self.daemon_log, "ab") as out:
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "lazarus.cli", "daemon", "--etcd", self.endpoint,
                 "--api", "off", "--endpoint-file", "", "--data-dir",
                 str(self.workdir / "daemon"), *self.daemon_args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent)
        self._proc = psutil.Process(self.daemon.pid)
        return self

    def daemon_usage(self) -> tuple[float, int]:
        """(CPU seconds so far, resident bytes) of the daemon."""
        if self.daemon is None or self.daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited ({self.daemon.returncode if self.daemon else '-'});"
                               f" see {self.daemon_log}")
        t = self._proc.cpu_times()
        return t.user + t.system, self._proc.memory_info().rss

    def etcd_process(self) -> psutil.Process | None:
        return (psutil.Process(self.embedded.proc.pid)
                if self.embedded is not None and self.embedded.running else None)

    def metrics(self) -> dict[str, float]:
        """etcd's Prometheus counters and gauges (unlabelled ones), from its metrics URL
        (embedded) or client URL."""
        if self.embedded is not None:
            url, context = self.embedded.metrics_url, None
        elif self.auth.tls:
            url, context = f"https://{self.endpoint.split(',')[0]}/metrics", _tls_context(self.auth)
        else:
            url, context = f"http://{self.endpoint.split(',')[0]}/metrics", None
        with urllib.request.urlopen(url, timeout=5, context=context) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line.startswith("etcd_") and "{" not in name:
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def stop(self) -> None:
        if self.daemon is not None:
            procstop.stop(self.daemon, 15)
        if self.embedded is not None:
            self.embedded.stop()


@dataclass(slots=True)
class Figures:
    nodes: int
    nproc: int
    steady_s: float = 0.0
    daemon_cores: float | None = None
    daemon_rss: int | None = None
    writes_per_s: float | None = None
    status_writes_per_s: float | None = None
    faults: list[Fault] = field(default_factory=list)
    day: dict = field(default_factory=dict)
    first_round_s: float | None = None
    lag: tuple[float, float] = (0.0, 0.0)   # Fleet.lag()
    sim_cores: float | None = None
    etcd_cores: float | None = None

    def decisions(self, kind: str) -> list[float]:
        return [f.decision_s for f in self.faults if f.kind == kind and f.decision_s is not None]

    def totals(self, kind: str) -> list[float]:
        return [f.total_s for f in self.faults if f.kind == kind and f.total_s is not None]

    def table(self) -> str:
        """The figures against the targets, one row each; ratio = measured / target."""
        rows: list[tuple[str, str, str, str]] = []

        def row(label: str, measured: str, target: str = "", ratio: float | None = None):
            rows.append((label, measured, target, f"{ratio:.2f}x" if ratio is not None else ""))

        def spread(xs: list[float]) -> str:
            if not xs:
                return "-"
            return f"median {statistics.median(xs):.3f} s, max {max(xs):.3f} s ({len(xs)} faults)"

        row("nodes x ranks", f"{self.nodes} x {self.nproc}")
        for kind, label in (("node_lost", "node loss"), ("worker_crash", "worker crash")):
            d = self.decisions(kind)
            row(f"{label}: seen -> round committed", spread(d), f"< {TARGET_DECISION_S:g} s",
                max(d) / TARGET_DECISION_S if d else None)
            row(f"{label}: fault -> round committed", spread(self.totals(kind)))
        if self.daemon_cores is not None:
            row("daemon CPU, steady", f"{self.daemon_cores:.3f} cores",
                f"< {TARGET_DAEMON_CORES:g} core", self.daemon_cores / TARGET_DAEMON_CORES)
            row("daemon RSS, steady", f"{self.daemon_rss / 2**20:.0f} MiB")
        if self.writes_per_s is not None:
            per_node = self.writes_per_s / self.nodes
            row("etcd writes/s, steady",
                (f"{self.writes_per_s:.1f}, {per_node:.3f} per node (status writes "
                 f"{self.status_writes_per_s:.1f})"),
                f"<= {BUDGET_WRITES_PER_NODE_S:g} per node", per_node / BUDGET_WRITES_PER_NODE_S)
        if self.day:
            d = self.day
            row("etcd DB size, compressed day",
                (f"peak {d['db_peak'] / 1e6:.1f} MB, end {d['db_end'] / 1e6:.1f} MB (in use "
                 f"{d['in_use_end'] / 1e6:.1f} MB)"),
                f"< {TARGET_DB_BYTES / 1e6:g} MB", d["db_peak"] / TARGET_DB_BYTES)
            row("  peak in 1st half / 2nd half",
                f"{d['db_peak_first'] / 1e6:.1f} MB / {d['db_peak_second'] / 1e6:.1f} MB",
                "flat", d["db_peak_second"] / max(1, d["db_peak_first"]))
            row("  the day",
                (f"{d['simulated_h']:.1f} h at x{d['compression']:.1f} in {d['wall_s']:.0f} s, "
                 f"{d['faults']} faults, {d['writes_per_s']:.0f} etcd writes/s"))
            row("  live keys at the end", ", ".join(
                f"{kind} {count} ({size / 1e6:.1f} MB)" for kind, (count, size)
                in sorted(d["keyspace"].items(), key=lambda kv: -kv[1][1])))
        if self.sim_cores is not None:
            row("CPU of the others, steady",
                f"simulator {self.sim_cores:.2f} cores, etcd {self.etcd_cores or 0:.2f} cores")
        row("simulator lag, worst",
            f"agent pass {self.lag[0]:.2f} s, lease renewals {self.lag[1]:.2f} s late",
            "<< lease TTL")
        width = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip()
                 for r in [("", "measured", "target", "ratio"), *rows]]
        return "\n".join(lines)


def _tls_context(auth: EtcdAuth) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=auth.ca.decode())
    if "cert" in auth.files:
        context.load_cert_chain(auth.files["cert"], auth.files["key"])
    return context


class FleetRun:
    """The control plane, the fleet, and the phases that measure them. `compression`: how
    much faster time runs in the compressed day; etcd's compaction (embedded) and the
    daemon's run that much faster throughout, so that the history etcd holds -- writes/s x
    the compaction window -- is the same as at the real pace."""

    def __init__(self, config: FleetConfig, workdir: Path, *, endpoint: str | None = None,
                 auth: EtcdAuth | None = None, compression: float = 1.0):
        self.config = config
        self.workdir = workdir
        self.compression = compression
        window_s = COMPACT_EVERY_S / compression
        self.plane = ControlPlane(workdir, endpoint=endpoint, auth=auth,
                                  daemon_args=["--compact-every", f"{window_s:g}"],
                                  compaction_retention=f"{max(1, round(window_s))}s")
        self.keys = Keys()
        self.etcd: E.Etcd | None = None
        self.fleet: Fleet | None = None
        self.figures = Figures(nodes=config.nodes, nproc=config.nproc)

    def __enter__(self) -> FleetRun:  # noqa: PYI034
        try:
            self.plane.start()
            self.etcd = E.Etcd(self.plane.endpoint, auth=self.plane.auth)
            self.fleet = Fleet(self.etcd, self.keys, self.config,
                               scratch=self.workdir / "scratch")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.fleet is not None:
            self.fleet.stop(revoke=False)
        self.plane.stop()
        if self.etcd is not None:
            self.etcd.close()

    def start(self, *, timeout_s: float = 600.0) -> None:
        """Register the fleet, submit the job, wait for the first round to run."""
        t0 = time.time()
        self.fleet.start()
        E.retry(lambda: self.etcd.put(self.keys.job, job_for(self.config).to_json()),
                deadline_s=30)
        st = self.fleet.wait_running(timeout_s=timeout_s)
        self.figures.first_round_s = time.time() - t0
        self.fleet.reset_lag()  # registering thousands of nodes is not the steady pace
        log.info("round %d running on %d nodes after %.1f s", st.round, len(st.members),
                 self.figures.first_round_s)

    def steady(self, seconds: float) -> None:
        """No faults for `seconds`, rounded to whole status periods (agents write in step: a
        round starts them together), after one period that lets every agent settle: the
        daemon's CPU and RSS, etcd's writes."""
        period = self.config.status_period_s
        seconds = max(1, round(seconds / period)) * period
        time.sleep(period)
        me, server = psutil.Process(), self.plane.etcd_process()
        cpu0, _ = self.plane.daemon_usage()
        sim0, etcd0 = _cpu(me), _cpu(server)
        rev0, t0 = self.etcd.revision(self.keys.root), time.monotonic()
        status0 = self.fleet.counts()["status"]
        time.sleep(seconds)
        cpu1, rss = self.plane.daemon_usage()
        rev1, t1 = self.etcd.revision(self.keys.root), time.monotonic()
        f = self.figures
        f.sim_cores = (_cpu(me) - sim0) / (t1 - t0)
        f.etcd_cores = (_cpu(server) - etcd0) / (t1 - t0) if server else None
        f.steady_s = t1 - t0
        f.daemon_cores = (cpu1 - cpu0) / f.steady_s
        f.daemon_rss = rss
        f.writes_per_s = (rev1 - rev0) / f.steady_s
        f.status_writes_per_s = (self.fleet.counts()["status"] - status0) / f.steady_s
        f.lag = self.fleet.lag()
        log.info("steady %.0f s: daemon %.3f cores, %.0f MiB; etcd %.1f writes/s", f.steady_s,
                 f.daemon_cores, rss / 2**20, f.writes_per_s)

    def fault(self, kind: str, *, timeout_s: float = 300.0) -> Fault:
        inject = self.fleet.lose_node if kind == "node_lost" else self.fleet.crash
        fault = self.fleet.wait_recovered(inject(), timeout_s=timeout_s)
        self.figures.faults.append(fault)
        self.figures.lag = self.fleet.lag()
        log.info("%s", describe([fault]))
        return fault

    def day(self, *, wall_s: float, fault_every_s: float, sample_every_s: float = 5.0) -> None:
        """`wall_s` of running with the status period divided by the run's compression and a
        fault (node loss and worker crash in turn) every `fault_every_s` (after the last one
        has recovered); etcd's database size sampled every `sample_every_s`, and what its
        live keys hold at the end."""
        fleet, compression = self.fleet, self.compression
        for agent in list(fleet.agents.values()):
            agent.publisher.period_s = self.config.status_period_s / compression
            agent.publisher.next_period_s = agent.publisher.period_s
        fleet.config.status_period_s = self.config.status_period_s / compression
        samples: list[tuple[float, int, float]] = []
        t0 = time.monotonic()
        rev0 = self.etcd.revision(self.keys.root)
        next_fault, next_sample, faults = t0 + fault_every_s / 2, t0, 0
        while (now := time.monotonic()) < t0 + wall_s:
            if now >= next_sample:
                m = self.plane.metrics()
                samples.append((now - t0, int(m.get("etcd_mvcc_db_total_size_in_bytes", 0)),
                                m.get("etcd_mvcc_db_total_size_in_use_in_bytes", 0.0)))
                log.info("day +%.0f s: etcd DB %.1f MB on disk, %.1f MB in use", samples[-1][0],
                         samples[-1][1] / 1e6, samples[-1][2] / 1e6)
                next_sample = now + sample_every_s
            if now >= next_fault:
                kind = "node_lost" if faults % 2 == 0 else "worker_crash"
                self.figures.faults.append(self.fleet.wait_recovered(
                    fleet.lose_node() if kind == "node_lost" else fleet.crash(),
                    timeout_s=300))
                faults += 1
                next_fault = time.monotonic() + fault_every_s
            time.sleep(0.2)
        wall = time.monotonic() - t0
        half = [s for s in samples if s[0] < wall / 2], [s for s in samples if s[0] >= wall / 2]
        m = self.plane.metrics()
        self.figures.day = {
            "wall_s": wall, "compression": compression,
            "simulated_h": wall * compression / 3600, "faults": faults,
            "writes_per_s": (self.etcd.revision(self.keys.root) - rev0) / wall,
            "db_end": int(m.get("etcd_mvcc_db_total_size_in_bytes", 0)),
            "in_use_end": m.get("etcd_mvcc_db_total_size_in_use_in_bytes", 0.0),
            "db_peak": max(s[1] for s in samples),
            "db_peak_first": max((s[1] for s in half[0]), default=0),
            "db_peak_second": max((s[1] for s in half[1]), default=0),
            "samples": samples, "keyspace": self.keyspace()}

    def keyspace(self) -> dict[str, tuple[int, int]]:
        """kind of key (the first path element under the root) -> (keys, bytes of values)."""
        out: dict[str, tuple[int, int]] = {}
        for key, kv in self.etcd.get_prefix(self.keys.root).kvs.items():
            kind = key[len(self.keys.root):].split("/")[0]
            n, size = out.get(kind, (0, 0))
            out[kind] = (n + 1, size + len(key) + len(kv.value))
        return out


def _cpu(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    t = proc.cpu_times()
    return t.user + t.system


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lazarus fleet", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=64, help="active nodes (default %(default)s)")
    p.add_argument("--spares", type=int, default=None,
                   help="spare nodes (default: 1 per 64 nodes, at least 2)")
    p.add_argument("--nproc", type=int, default=8, help="ranks per node (default %(default)s)")
    p.add_argument("--etcd", default=None,
                   help="etcd HOST:PORT[,HOST:PORT...] to use (default: an embedded one); "
                        "give it to yourself: the fleet writes under the default key root "
                        "(its user needs the daemon's rights)")
    settings.add_etcd_security_args(p)
    p.add_argument("--step-time", type=float, default=None,
                   help="seconds per training step (default: one agent message per rank "
                        "and step, at most ~4,000 a second)")
    p.add_argument("--steady", type=float, default=60.0,
                   help="seconds of the steady phase (default %(default)s)")
    p.add_argument("--crashes", type=int, default=3, help="worker crashes (default %(default)s)")
    p.add_argument("--losses", type=int, default=3, help="node losses (default %(default)s)")
    p.add_argument("--day", type=float, default=0.0, metavar="SECONDS",
                   help="seconds of the compressed day (default 0: none)")
    p.add_argument("--compression", type=float, default=10.0,
                   help="time runs this much faster in the day: status writes more often, "
                        "etcd and the daemon compact more often (default %(default)s)")
    p.add_argument("--fault-every", type=float, default=30.0,
                   help="seconds between the day's faults (default %(default)s)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="etcd's data and the daemon's log (default: a temp dir)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logs.setup(args.log_level, "fleet")
    config = fleet_config(args.nodes, spares=args.spares, nproc=args.nproc,
                          step_time_s=args.step_time)
    for name in ("steady", "crashes", "losses", "day", "fault_every"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative")
    if not args.compression >= 1:
        raise UserError("--compression must be at least 1")
    auth = settings.etcd_auth(args)
    if args.etcd is not None:
        auth.check(args.etcd, [E.parse_endpoint(m)[0] for m in E.parse_endpoints(args.etcd)])
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lazarus-fleet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with FleetRun(config, workdir, endpoint=args.etcd, auth=auth,
                  compression=args.compression) as run:
        run.start()
        if args.steady:
            run.steady(args.steady)
        for i in range(max(args.crashes, args.losses)):
            if i < args.losses:
                run.fault("node_lost")
            if i < args.crashes:
                run.fault("worker_crash")
        if args.day:
            run.day(wall_s=args.day, fault_every_s=args.fault_every)
        print(run.figures.table())
    print(f"(etcd data and the daemon's log: {workdir})")
    return 0


def fleet_config(nodes: int, *, spares: int | None = None, nproc: int = 8,
                 step_time_s: float | None = None, **kw) -> FleetConfig:
    """A fleet of `nodes` x `nproc` with the agents' defaults; the step time keeps the
    simulator's agent messages near 4,000 a second."""
    if spares is None:
        spares = max(2, nodes // 64)
    if step_time_s is None:
        step_time_s = max(1.0, nodes * nproc / 4000)
    return FleetConfig(nodes=nodes, spares=spares, nproc=nproc, step_time_s=step_time_s,
                       **kw).check()

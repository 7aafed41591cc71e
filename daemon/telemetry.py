"""OpenTelemetry for the daemon: one trace per incident, and the run's health as metrics.

Traces. Every incident (a `fault_detected` event) becomes one trace, `incident`, whose five
children cover the recovery end to end, with the timestamps the events carry:

    detect       fault_at -> detected_at        the fault happened / the daemon named it
    decide       detected_at -> round_started   members and checkpoint chosen (includes
                                                waiting for a spare or for min_nodes)
    rendezvous   round_started -> joined        every member's agent took the round (launched
                                                or promoted its ranks)
    restore      joined -> first step began     ranks build the model, join the process group
                                                and load the checkpoint
    first_step   -> recovered_at                the first optimizer step after the restore

`joined` and the first step's duration are not events: the daemon sees them in the node
statuses of the pass they appear in. A daemon that took over the lead in the middle of an
incident has not seen them; its rendezvous span then reaches the first step (restore is empty
and marked `lazarus.observed = false`). The trace is emitted when the incident ends: recovered
(status OK), or the run failed / was cancelled / another fault came first (status ERROR).
Only the leader emits; standbys follow the events so that a new leader can finish the trace.

Metrics are read from the daemon's cached view once per loop pass (daemon.health, what
`lazarus status` shows); instrument names and their Prometheus forms are listed in METRICS. Checkpoint stall is
not among them: the trainer's metrics file records it (lazarus.core.stall), but nothing of it
reaches etcd, so the daemon has nothing to export.

Export: OTLP over HTTP when an endpoint is configured (a collector's base URL, e.g.
http://collector:4318; /v1/traces and /v1/metrics are appended), and a Prometheus scrape
endpoint (/metrics) when a port is given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

from lazarus.core import etcd as E
from lazarus.daemon import health, metricsport
from lazarus.daemon.history import History
from lazarus.daemon.view import ClusterView, LiveView, parse
from lazarus.core.errors import UserError
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from lazarus.core.records import STATES, EventRecord, Keys, number

log = logging.getLogger(__name__)

SPANS = ("detect", "decide", "rendezvous", "restore", "first_step")

# OTel instrument -> the name Prometheus shows (unit suffixes added by the exporter).
METRICS = {
    "lazarus.tokens_per_second": "lazarus_tokens_per_second",
    "lazarus.step_time": "lazarus_step_time_seconds",
    "lazarus.goodput": "lazarus_goodput",
    "lazarus.wall_time": "lazarus_wall_time_seconds",
    "lazarus.productive_time": "lazarus_productive_time_seconds",
    "lazarus.run.step": "lazarus_run_step",
    "lazarus.run.restarts": "lazarus_run_restarts",
    "lazarus.run.state": "lazarus_run_state",
    "lazarus.incident.open": "lazarus_incident_open",
    "lazarus.nodes": "lazarus_nodes",
    "lazarus.checkpoint.step": "lazarus_checkpoint_step",
    "lazarus.checkpoint.age": "lazarus_checkpoint_age_seconds",
    "lazarus.recovery.duration": "lazarus_recovery_duration_seconds",
    "lazarus.recovery.detection": "lazarus_recovery_detection_seconds",
}

# Recoveries take from under a second (warm spare) to many minutes (cold start of a big model).
_RECOVERY_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
_TERMINAL_KINDS = ("failed", "cancelled", "succeeded")


def _ns(t: float) -> int:
    return int(t * 1e9)


@dataclass(slots=True)
class RoundProgress:
    """What one snapshot shows of the current round: whether every member's agent has taken
    it, and the (slowest) step time members report once all of them are training."""
    round: int
    joined: bool
    step_time_s: float | None


@dataclass(slots=True)
class _Incident:
    kind: str
    culprit: str
    fault_at: float
    detected_at: float
    job_id: str = ""
    round: int | None = None        # the recovery round
    round_at: float | None = None
    joined_at: float | None = None
    first_step_s: float | None = None


class IncidentTracer:
    """Turns a run's events, oldest first, into one trace per incident (see the module doc)."""

    def __init__(self, tracer: trace.Tracer, meter: Meter):
        self._tracer = tracer
        self._open: _Incident | None = None
        self._recovery = meter.create_histogram(
            "lazarus.recovery.duration", unit="s",
            description="fault to first step after the restore, per recovered incident",
            explicit_bucket_boundaries_advisory=_RECOVERY_BUCKETS)
        self._detection = meter.create_histogram(
            "lazarus.recovery.detection", unit="s",
            description="fault to detection, per recovered incident",
            explicit_bucket_boundaries_advisory=_RECOVERY_BUCKETS)

    def feed(self, ev: EventRecord, *, live: bool, job_id: str = "") -> None:
        """`live`: emit the trace if this event ends an incident (False while replaying
        history the previous leader already reported, or on a standby)."""
        inc = self._open
        if ev.kind == "fault_detected":
            if inc is not None:
                self._close(inc, ev.time, live=live, ok=False,
                            why=f"another fault before recovery: {ev.message}")
            f = ev.fields
            self._open = _Incident(kind=str(f.get("kind", "")), culprit=str(f.get("culprit", "")),
                                   fault_at=_number(f.get("fault_at"), ev.time),
                                   detected_at=_number(f.get("detected_at"), ev.time),
                                   job_id=job_id)
        elif inc is None:
            return
        elif ev.kind == "round_started" and inc.round is None:
            inc.round, inc.round_at = ev.round, ev.time
        elif ev.kind == "recovered":
            self._close(inc, _number(ev.fields.get("recovered_at"), ev.time), live=live, ok=True,
                        why=ev.message)
        elif ev.kind in _TERMINAL_KINDS:
            self._close(inc, ev.time, live=live, ok=False, why=ev.message)

    def progress(self, now: float, p: RoundProgress) -> None:
        inc = self._open
        if inc is None or inc.round != p.round:
            return
        if p.joined and inc.joined_at is None:
            inc.joined_at = now
        if p.step_time_s is not None and inc.first_step_s is None:
            inc.first_step_s = p.step_time_s

    def _close(self, inc: _Incident, end: float, *, live: bool, ok: bool, why: str) -> None:
        self._open = None
        if not live:
            return
        attrs = {"lazarus.incident.kind": inc.kind, "lazarus.incident.culprit": inc.culprit,
                 "lazarus.job_id": inc.job_id}
        if inc.round is not None:
            attrs["lazarus.round"] = inc.round
        root = self._tracer.start_span("incident", start_time=_ns(inc.fault_at),
                                       attributes=attrs)
        ctx = trace.set_span_in_context(root)
        for name, start, stop, observed in _phases(inc, end):
            span = self._tracer.start_span(name, context=ctx, start_time=_ns(start),
                                           attributes={"lazarus.observed": observed})
            span.end(end_time=_ns(stop))
        root.set_status(Status(StatusCode.OK) if ok else Status(StatusCode.ERROR, why))
        root.set_attribute("lazarus.outcome", why)
        root.end(end_time=_ns(max(end, inc.fault_at)))
        if ok:
            self._recovery.record(max(0.0, end - inc.fault_at), {"kind": inc.kind})
            self._detection.record(max(0.0, inc.detected_at - inc.fault_at), {"kind": inc.kind})


def _phases(inc: _Incident, end: float) -> list[tuple[str, float, float, bool]]:
    """(name, start, end, observed) of the phases this incident got through before `end`.
    Boundaries are clamped so the phases never overlap or run backwards."""
    t = [inc.fault_at]

    def mark(at: float | None) -> float:
        t.append(min(max(at if at is not None else t[-1], t[-1]), end))
        return t[-1]

    mark(inc.detected_at)
    if inc.round_at is None:
        return [("detect", t[0], t[1], True), ("decide", t[1], end, True)]
    mark(inc.round_at)
    first_step_at = end - inc.first_step_s if inc.first_step_s is not None else end
    mark(inc.joined_at if inc.joined_at is not None else first_step_at)
    mark(first_step_at)
    mark(end)
    observed = [True, True, True, inc.joined_at is not None, inc.first_step_s is not None]
    return [(name, t[i], t[i + 1], observed[i]) for i, name in enumerate(SPANS)]


def _number(value, default: float) -> float:
    n = number(value)
    return default if n is None else n


class RunMetrics:
    """Observable instruments reading the latest RunHealth (set by `update`)."""

    def __init__(self, meter: Meter):
        self._h: pb.RunHealth | None = None
        self._now = 0.0
        g = meter.create_observable_gauge

        def gauge(name: str, unit: str, description: str, read):
            def callback(_options: CallbackOptions) -> Iterable[Observation]:
                h = self._h
                return [] if h is None or not h.job_id else read(h)
            g(name, [callback], unit=unit, description=description)

        gauge("lazarus.tokens_per_second", "{token}/s", "training throughput (rank 0's node)",
              lambda h: [Observation(h.tokens_per_s)])
        gauge("lazarus.step_time", "s", "duration of the latest optimizer step",
              lambda h: [Observation(h.step_time_s)])
        gauge("lazarus.goodput", "1", "productive time / wall time of the run (ETTR)",
              lambda h: [Observation(h.goodput)] if h.goodput >= 0 else [])
        gauge("lazarus.wall_time", "s", "time since the job was accepted",
              lambda h: [Observation(h.wall_time_s)])
        gauge("lazarus.productive_time", "s", "time spent training with no open incident",
              lambda h: [Observation(h.productive_time_s)])
        gauge("lazarus.run.step", "{step}", "latest optimizer step",
              lambda h: [Observation(h.step)])
        gauge("lazarus.run.restarts", "{restart}", "recoveries so far",
              lambda h: [Observation(h.restarts)])
        gauge("lazarus.run.state", "1", "1 for the run's current state, 0 for the others",
              lambda h: [Observation(int(s == h.state), {"state": s}) for s in STATES])
        gauge("lazarus.incident.open", "1", "1 while an incident is being recovered",
              lambda h: [Observation(int(h.HasField("incident")))])
        gauge("lazarus.checkpoint.step", "{step}", "step of the latest committed checkpoint",
              lambda h: [Observation(h.last_checkpoint.step)]
              if h.HasField("last_checkpoint") else [])
        gauge("lazarus.checkpoint.age", "s", "time since the latest checkpoint was committed",
              lambda h: [Observation(max(0.0, self._now - h.last_checkpoint.committed_at))]
              if h.HasField("last_checkpoint") else [])

        def nodes(_options: CallbackOptions) -> Iterable[Observation]:
            h = self._h
            return [] if h is None else [Observation(n, {"state": s})
                                         for s, n in sorted(h.nodes_by_state.items())]
        g("lazarus.nodes", [nodes], unit="{node}", description="nodes by state")

    def update(self, h: pb.RunHealth, now: float) -> None:
        self._h, self._now = h, now


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    """`otlp_endpoint`: an OTLP/HTTP collector's base URL (None: no OTLP export).
    `metrics_port`: serve Prometheus text on http://metrics_host:metrics_port/metrics
    (None: off; 0: any free port)."""
    otlp_endpoint: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    export_interval_s: float = 15.0
    resource: dict = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None or self.metrics_port is not None


class Telemetry:
    """Fed once per loop pass (`on_pass`) by the daemon, from the daemon's cached view
    (`views`; without one, a snapshot per pass). `history`: the daemon's archive of events
    pruned from etcd, which the goodput still counts."""

    def __init__(self, etcd: E.Etcd | None, keys: Keys, *, served_by: str,
                 tracer_provider: TracerProvider, meter_provider: MeterProvider,
                 closers: Iterable = (), metrics_port: int | None = None,
                 history: History | None = None, views: LiveView | None = None):
        self.etcd, self.keys, self.served_by = etcd, keys, served_by
        self.history = history
        self.views = views
        self.tracer_provider, self.meter_provider = tracer_provider, meter_provider
        meter = meter_provider.get_meter("lazarus")
        self.incidents = IncidentTracer(tracer_provider.get_tracer("lazarus"), meter)
        self.metrics = RunMetrics(meter)
        self._seen: set[str] = set()
        self._replayed = False
        self._closers = list(closers)
        self.metrics_port = metrics_port  # the port Prometheus scrapes, once bound

    def on_pass(self, leader: bool) -> None:
        """The daemon loop's hook: one view, then events and metrics from it."""
        if self.views is not None:
            self.observe_view(self.views.current(), leader=leader, now=time.time())
        else:
            assert self.etcd is not None
            self.observe(self.etcd.snapshot(health.prefixes(self.keys)), leader=leader,
                         now=time.time())

    def observe(self, snap: E.Snapshot, *, leader: bool, now: float) -> None:
        self.observe_view(parse(snap, self.keys), leader=leader, now=now)

    def observe_view(self, view: ClusterView, *, leader: bool, now: float) -> None:
        h = health.run_health(view, now=now, served_by=self.served_by,
                              all_events=health.with_history(self.history, view))
        self.metrics.update(h, now)
        # Incidents that ended before this daemon first looked were reported by whoever led
        # then; so were those that end while this daemon is a standby.
        live = leader and self._replayed
        for kv, ev in view.events:
            if kv.key in self._seen:
                continue
            self._seen.add(kv.key)
            self.incidents.feed(ev, live=live, job_id=h.job_id)
        self._replayed = True
        if h.job_id:
            self.incidents.progress(now, _progress(view, h))

    def shutdown(self) -> None:
        for close in self._closers:
            close()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def _progress(view: ClusterView, h: pb.RunHealth) -> RoundProgress:
    current = [view.node_status.get(n) for n in h.members]
    joined = bool(current) and all(ns is not None and ns.round == h.round for ns in current)
    training = joined and all(ns.workers in ("running", "succeeded") for ns in current)
    return RoundProgress(round=h.round, joined=joined,
                         step_time_s=max(ns.step_time_s for ns in current) if training else None)


def start(cfg: TelemetryConfig, etcd: E.Etcd, keys: Keys, *, served_by: str,
          history: History | None = None, views: LiveView | None = None) -> Telemetry:
    """Providers and exporters as `cfg` asks; the caller calls shutdown() at the end.
    `views`: the daemon's cached view, read once a pass."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    resource = Resource.create({"service.name": "lazarus-daemon",
                                "service.instance.id": served_by, **cfg.resource})
    tracer_provider = TracerProvider(resource=resource)
    readers = []
    closers = []
    if cfg.otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        base = cfg.otlp_endpoint.rstrip("/")
        tracer_provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
        readers.append(PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=f"{base}/v1/metrics"),
            export_interval_millis=cfg.export_interval_s * 1000))
    port = None
    if cfg.metrics_port is not None:
        import prometheus_client
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        registry = prometheus_client.CollectorRegistry()
        readers.append(PrometheusMetricReader(registry=registry))
        try:
            server, _thread = metricsport.serve(cfg.metrics_host, cfg.metrics_port, registry)
        except OSError as e:
            raise UserError(f"--metrics-port {cfg.metrics_port}: cannot listen on "
                            f"{cfg.metrics_host}: {e.strerror}") from None
        port = server.server_port

        def close_server() -> None:
            server.shutdown()
            server.server_close()
        closers.append(close_server)
    return Telemetry(etcd, keys, served_by=served_by, tracer_provider=tracer_provider,
                     meter_provider=MeterProvider(resource=resource, metric_readers=readers),
                     closers=closers, metrics_port=port, history=history, views=views)

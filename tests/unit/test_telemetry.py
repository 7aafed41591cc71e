"""Incident traces from a run's events: five phases in order with the durations the events
and node progress imply, errors for incidents that never recovered, no duplicates of
incidents another leader already reported."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from lazarus.core.records import EventRecord
from lazarus.daemon.telemetry import SPANS, IncidentTracer, RoundProgress


@pytest.fixture
def otel():
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    tracer = IncidentTracer(tp.get_tracer("test"), mp.get_meter("test"))
    yield tracer, spans, reader
    tp.shutdown()
    mp.shutdown()


def ev(t, event, round=0, **fields):
    return EventRecord(time=t, kind=event, message=f"{event} at {t}", round=round, fields=fields)


def crash_until_running(tracer, *, live=True):
    """Worker crash at 100.0, seen at 100.5; round 3 chosen at 101.0; every agent took it at
    101.5; the first step (0.3 s) reported at 103.0."""
    tracer.feed(ev(90.0, "running", round=2), live=live)
    tracer.feed(ev(100.5, "fault_detected", round=2, kind="worker_crash", culprit="n1",
                   fault_at=100.0, detected_at=100.5), live=live)
    tracer.feed(ev(101.0, "round_started", round=3, restore_step=20), live=live)
    tracer.progress(101.2, RoundProgress(round=3, joined=False, step_time_s=None))
    tracer.progress(101.5, RoundProgress(round=3, joined=True, step_time_s=None))
    tracer.feed(ev(103.0, "running", round=3), live=live)
    tracer.progress(103.0, RoundProgress(round=3, joined=True, step_time_s=0.3))


def histogram_points(reader, name):
    out = []
    data = reader.get_metrics_data()  # None when nothing was recorded at all
    for rm in data.resource_metrics if data is not None else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    out += list(m.data.data_points)
    return out


def test_a_recovery_becomes_one_trace_of_five_phases_in_order(otel):
    tracer, spans, reader = otel
    crash_until_running(tracer)
    assert spans.get_finished_spans() == ()  # emitted when the incident ends, all at once
    tracer.feed(ev(103.1, "recovered", round=3, recovered_at=103.1, first_step=21), live=True)

    finished = spans.get_finished_spans()
    root = next(s for s in finished if s.name == "incident")
    phases = sorted((s for s in finished if s.parent is not None), key=lambda s: s.start_time)
    assert [s.name for s in phases] == list(SPANS)
    assert all(s.parent.span_id == root.context.span_id for s in phases)
    assert {s.context.trace_id for s in finished} == {root.context.trace_id}
    durations = [(s.end_time - s.start_time) / 1e9 for s in phases]
    assert durations == pytest.approx([0.5, 0.5, 0.5, 103.1 - 0.3 - 101.5, 0.3], abs=1e-6)
    # contiguous: each phase starts where the previous one ended, fault to recovery
    assert [s.start_time for s in phases[1:]] == [s.end_time for s in phases[:-1]]
    assert (root.start_time, root.end_time) == (phases[0].start_time, phases[-1].end_time)
    assert root.status.status_code == StatusCode.OK
    assert root.attributes["lazarus.incident.kind"] == "worker_crash"
    assert root.attributes["lazarus.incident.culprit"] == "n1"
    assert root.attributes["lazarus.round"] == 3

    [rec] = histogram_points(reader, "lazarus.recovery.duration")
    assert (rec.count, rec.sum, dict(rec.attributes)) == (1, pytest.approx(3.1),
                                                          {"kind": "worker_crash"})
    [det] = histogram_points(reader, "lazarus.recovery.detection")
    assert det.sum == pytest.approx(0.5)


def test_a_run_that_fails_mid_recovery_ends_its_trace_with_an_error(otel):
    tracer, spans, reader = otel
    tracer.feed(ev(10.0, "fault_detected", kind="node_lost", culprit="n2", fault_at=10.0,
                   detected_at=10.0), live=True)
    tracer.feed(ev(70.0, "failed", round=1), live=True)
    finished = spans.get_finished_spans()
    root = next(s for s in finished if s.name == "incident")
    assert root.status.status_code == StatusCode.ERROR
    assert "failed at 70.0" in root.status.description
    # it never got to a new round: detect, then a decide phase that lasted until the end
    assert [s.name for s in finished if s.parent is not None] == ["detect", "decide"]
    assert histogram_points(reader, "lazarus.recovery.duration") == []


def test_a_second_fault_during_recovery_closes_the_first_incident(otel):
    tracer, spans, _ = otel
    crash_until_running(tracer)
    tracer.feed(ev(104.0, "fault_detected", round=3, kind="rendezvous_timeout", culprit="n0",
                   fault_at=104.0, detected_at=104.0), live=True)
    tracer.feed(ev(105.0, "round_started", round=4), live=True)
    tracer.feed(ev(106.0, "recovered", round=4, recovered_at=106.0), live=True)
    roots = [s for s in spans.get_finished_spans() if s.name == "incident"]
    assert [(r.attributes["lazarus.incident.kind"], r.status.status_code) for r in roots] == [
        ("worker_crash", StatusCode.ERROR), ("rendezvous_timeout", StatusCode.OK)]


def test_replayed_history_emits_nothing_and_a_new_leader_finishes_the_open_incident(otel):
    tracer, spans, _ = otel
    tracer.feed(ev(1.0, "fault_detected", kind="worker_crash", fault_at=0.5, detected_at=1.0),
                live=False)
    tracer.feed(ev(2.0, "round_started", round=2), live=False)
    tracer.feed(ev(3.0, "recovered", round=2, recovered_at=3.0), live=False)
    assert spans.get_finished_spans() == ()  # the leader of that time reported it

    # Took over after the round started: the join and the first step's time were not seen.
    tracer.feed(ev(10.0, "fault_detected", kind="node_lost", fault_at=10.0, detected_at=10.0),
                live=False)
    tracer.feed(ev(11.0, "round_started", round=3), live=False)
    tracer.feed(ev(14.0, "recovered", round=3, recovered_at=14.0), live=True)
    phases = [s for s in spans.get_finished_spans() if s.parent is not None]
    got = {s.name: ((s.end_time - s.start_time) / 1e9, s.attributes["lazarus.observed"])
           for s in phases}
    assert got == {"detect": (0.0, True), "decide": (1.0, True), "rendezvous": (3.0, True),
                   "restore": (0.0, False), "first_step": (0.0, False)}


def test_the_grafana_dashboard_only_queries_metrics_we_export():
    import json
    import re
    from pathlib import Path

    from lazarus.daemon.telemetry import METRICS
    doc = json.loads((Path(__file__).parents[2] / "deploy/grafana/lazarus.json").read_text())
    used = set(re.findall(r"lazarus_[a-z_]+", json.dumps(doc)))
    exported = {n + s for n in METRICS.values() for s in ("", "_bucket", "_count", "_sum")}
    assert used and used <= exported, used - exported
    assert {"lazarus_goodput", "lazarus_tokens_per_second", "lazarus_step_time_seconds",
            "lazarus_nodes", "lazarus_recovery_duration_seconds_bucket"} <= used

"""Telemetry read from a real etcd: metric values from a populated snapshot, a recovery traced
as the daemon's passes see it happen, and Prometheus text served over real HTTP."""

from __future__ import annotations

import time
import urllib.request

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lazarus.daemon import telemetry
from lazarus.core.records import (CheckpointRecord, EventRecord, NodeRecord, NodeStatus,
                             RoundRecord, RunStatus, dumps)




@pytest.fixture
def otel(etcd, keys):
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    tel = telemetry.Telemetry(etcd, keys, served_by="d0", tracer_provider=tp,
                              meter_provider=MeterProvider(metric_readers=[reader]))
    yield tel, spans, reader
    tel.shutdown()


def event(etcd, keys, t, what, state, round, **fields):
    etcd.put(keys.event_key("test"), EventRecord(time=t, kind=what, message=what, state=state,
                                                 round=round, fields=fields).to_json())


def node_status(etcd, keys, node, round, workers, step=0, step_time_s=0.0, tokens_per_s=0.0):
    etcd.put(keys.nodestatus_key(node), NodeStatus(
        node=node, round=round, workers=workers, step=step, loss=2.0, step_time_s=step_time_s,
        tokens_per_s=tokens_per_s, updated_at=time.time()).to_json())


def populate(etcd, keys, t0: float) -> None:
    """Job J1 in round 2 on n0, n1 (n2 a spare): accepted at t0, running from t0+10, a worker
    crash at t0+38 (seen at t0+40), running again from t0+50; checkpoints at 10 and 20."""
    job = {"name": "tel", "nodes": 2, "min_nodes": 1, "nproc_per_node": 1, "id": "J1",
           "train": {"steps": 50, "model": {"name": "tiny"}, "data": {"global_batch": 4}}}
    etcd.put(keys.job, dumps(job))
    etcd.put(keys.accepted_job, dumps(job))
    etcd.put(keys.status, RunStatus(job_id="J1", state="RUNNING", round=2, members=["n0", "n1"],
                                    since=t0 + 45, restarts=1).to_json())
    etcd.put(keys.round_key(2), RoundRecord(
        round=2, job_id="J1", members=["n0", "n1"], nproc_per_node=1, world_size=2, dp=2, tp=1,
        store_host="127.0.0.1", store_port=1).to_json())
    for i, role in enumerate(["active", "active", "spare"]):
        etcd.put(keys.node_key(f"n{i}"), NodeRecord(node=f"n{i}", host="h", nproc=1,
                                                    role=role).to_json())
    node_status(etcd, keys, "n0", 2, "running", step=30, step_time_s=0.25, tokens_per_s=2048.0)
    node_status(etcd, keys, "n1", 2, "running", step=30, step_time_s=0.5, tokens_per_s=1024.0)
    for step in (10, 20):
        etcd.put(keys.checkpoint_key(step), CheckpointRecord(
            step=step, path=f"/ck/{step}", round=2, job_id="J1", committed_at=t0 + 60).to_json())
    event(etcd, keys, t0, "job_accepted", "PENDING", 0, id="J1")
    event(etcd, keys, t0 + 5, "round_started", "RENDEZVOUS", 1)
    event(etcd, keys, t0 + 10, "running", "RUNNING", 1)
    event(etcd, keys, t0 + 40, "fault_detected", "RECOVERING", 1, kind="worker_crash",
          culprit="n1", fault_at=t0 + 38, detected_at=t0 + 40)
    event(etcd, keys, t0 + 41, "round_started", "RENDEZVOUS", 2)
    event(etcd, keys, t0 + 50, "running", "RUNNING", 2)
    event(etcd, keys, t0 + 50, "recovered", "RUNNING", 2, recovered_at=t0 + 50)


def gauges(reader) -> dict:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    out[(m.name, tuple(sorted(p.attributes.items())))] = getattr(p, "value", None)
    return out


def test_metrics_read_from_a_populated_etcd(etcd, keys, otel):
    tel, spans, reader = otel
    t0 = time.time() - 100
    populate(etcd, keys, t0)
    now = t0 + 100
    tel.observe(etcd.snapshot(telemetry.health.prefixes(keys)), leader=True, now=now)
    got = gauges(reader)
    assert got[("lazarus.tokens_per_second", ())] == 2048.0  # rank 0's node
    assert got[("lazarus.step_time", ())] == 0.25
    # productive: 10..38 and 50..100 of 100 s
    assert got[("lazarus.productive_time", ())] == pytest.approx(78.0)
    assert got[("lazarus.wall_time", ())] == pytest.approx(100.0)
    assert got[("lazarus.goodput", ())] == pytest.approx(0.78)
    assert got[("lazarus.run.step", ())] == 30
    assert got[("lazarus.run.restarts", ())] == 1
    assert got[("lazarus.run.state", (("state", "RUNNING"),))] == 1
    assert got[("lazarus.run.state", (("state", "RECOVERING"),))] == 0
    assert got[("lazarus.incident.open", ())] == 0
    assert got[("lazarus.nodes", (("state", "running"),))] == 2
    assert got[("lazarus.nodes", (("state", "spare"),))] == 1
    assert got[("lazarus.checkpoint.step", ())] == 20
    assert got[("lazarus.checkpoint.age", ())] == pytest.approx(40.0)
    # the only incident was over before this daemon first looked: not this daemon's to report
    assert spans.get_finished_spans() == ()


def test_a_recovery_seen_pass_by_pass_is_traced_with_the_observed_join(etcd, keys, otel):
    tel, spans, reader = otel
    t0 = time.time() - 100
    populate(etcd, keys, t0)

    def pass_at(t):
        tel.observe(etcd.snapshot(telemetry.health.prefixes(keys)), leader=True, now=t)

    pass_at(t0 + 60)
    event(etcd, keys, t0 + 70, "fault_detected", "RECOVERING", 2, kind="node_lost",
          culprit="n1", fault_at=t0 + 69, detected_at=t0 + 70)
    pass_at(t0 + 70)
    etcd.put(keys.status, RunStatus(job_id="J1", state="RENDEZVOUS", round=3,
                                    members=["n0", "n2"], restarts=2).to_json())
    event(etcd, keys, t0 + 71, "round_started", "RENDEZVOUS", 3)
    pass_at(t0 + 71)
    node_status(etcd, keys, "n0", 3, "starting")
    pass_at(t0 + 71.5)  # n2 has not taken round 3 yet
    node_status(etcd, keys, "n2", 3, "starting")
    pass_at(t0 + 72)
    node_status(etcd, keys, "n0", 3, "running", step=21, step_time_s=0.4)
    node_status(etcd, keys, "n2", 3, "running", step=21, step_time_s=0.6)
    event(etcd, keys, t0 + 75, "running", "RUNNING", 3)
    pass_at(t0 + 75)
    event(etcd, keys, t0 + 75.1, "recovered", "RUNNING", 3, recovered_at=t0 + 75.1)
    pass_at(t0 + 75.1)

    phases = sorted((s for s in spans.get_finished_spans() if s.name != "incident"),
                    key=lambda s: s.start_time)
    got = [(s.name, round((s.end_time - s.start_time) / 1e9, 3)) for s in phases]
    assert got == [("detect", 1.0), ("decide", 1.0), ("rendezvous", 1.0),
                   ("restore", round(75.1 - 0.6 - 72, 3)), ("first_step", 0.6)]
    [root] = [s for s in spans.get_finished_spans() if s.name == "incident"]
    assert root.attributes["lazarus.incident.kind"] == "node_lost"
    assert root.attributes["lazarus.job_id"] == "J1"


def test_prometheus_endpoint_serves_our_metrics_over_http(etcd, keys):
    t0 = time.time() - 100
    populate(etcd, keys, t0)
    tel = telemetry.start(telemetry.TelemetryConfig(metrics_port=0), etcd, keys, served_by="d0")
    try:
        tel.on_pass(True)
        with urllib.request.urlopen(f"http://127.0.0.1:{tel.metrics_port}/metrics",
                                    timeout=10) as r:
            text = r.read().decode()
    finally:
        tel.shutdown()
    samples = {line.split("{")[0].split(" ")[0]: line for line in text.splitlines()
               if line.startswith("lazarus_")}
    for name in ("lazarus_tokens_per_second", "lazarus_step_time_seconds", "lazarus_goodput",
                 "lazarus_run_state", "lazarus_nodes", "lazarus_checkpoint_age_seconds",
                 "lazarus_incident_open", "lazarus_productive_time_seconds"):
        assert name in samples, f"{name} missing from:\n{text}"
    assert samples["lazarus_tokens_per_second"].endswith(" 2048.0")
    # every name the dashboard uses is one we export
    assert set(samples) <= {n + suffix for n in telemetry.METRICS.values()
                            for suffix in ("", "_bucket", "_count", "_sum")}

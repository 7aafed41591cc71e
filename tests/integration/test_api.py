"""The gRPC API over real TCP, served from daemon.api on a real etcd: every RPC, auth, TLS,
malformed and oversized requests, the CLI against it, and (e2e) a real fault's recovery
arriving through WatchEvents from a running local cluster's daemon, then `lazarus events
--follow` printing the `lazarus cancel` that ends the run."""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import threading
import time

import grpc
import pytest

from lazarus.ops import client
from lazarus.core import etcd as E
from lazarus.daemon import api
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from lazarus.proto.lazarus.v1 import lazarus_pb2_grpc as pb_grpc
from lazarus.core.records import (CheckpointRecord, EventRecord, Keys, NodeRecord, NodeStatus,
                             RoundRecord, RunStatus, dumps)

TOKEN = "s3cret-token-0123"
AUTH = [("authorization", f"Bearer {TOKEN}")]
READ_TOKEN = "read-only-token-0123"
READ = [("authorization", f"Bearer {READ_TOKEN}")]




@pytest.fixture
def server(etcd, keys):
    srv, port = api.serve(etcd, keys, address="127.0.0.1:0", token=TOKEN,
                          served_by="standby-1", max_streams=2)
    yield f"127.0.0.1:{port}"
    srv.stop(grace=0).wait()


@pytest.fixture
def roles(etcd, keys):
    """A server with an admin token and a read-only one; its address."""
    srv, port = api.serve(etcd, keys, address="127.0.0.1:0", token=TOKEN,
                          read_token=READ_TOKEN)
    yield f"127.0.0.1:{port}"
    srv.stop(grace=0).wait()


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server) as channel:
        yield pb_grpc.LazarusStub(channel)


def _job_toml(nodes=2, min_nodes=1) -> str:
    return (f'[job]\nname = "api"\nnodes = {nodes}\nmin_nodes = {min_nodes}\nid = "J1"\n'
            '[train]\nsteps = 50\n[train.model]\nname = "tiny"\n[train.data]\nglobal_batch = 4\n')


def _populate(etcd: E.Etcd, keys: Keys, *, t0: float, incident: dict | None = None) -> None:
    """A run of job J1 in round 2 on n0, n1 (n2 a spare), after one recovered worker crash."""
    job = {"name": "api", "nodes": 2, "min_nodes": 1, "nproc_per_node": 2, "id": "J1",
           "max_restarts": 20, "rendezvous_timeout_s": 60.0,
           "train": {"steps": 50, "model": {"name": "tiny"}, "data": {"global_batch": 4}}}
    etcd.put(keys.job, dumps(job))
    etcd.put(keys.accepted_job, dumps(job))
    etcd.put(keys.leader, dumps({"id": "leader-0", "pid": 4242, "host": "h", "api": "h:7070"}))
    etcd.put(keys.status, RunStatus(job_id="J1", state="RUNNING", round=2, members=["n0", "n1"],
                                    reason="round 2: all 2 node(s) running", since=t0 + 45,
                                    restarts=1, incident=incident).to_json())
    etcd.put(keys.round_key(2), RoundRecord(
        round=2, job_id="J1", members=["n0", "n1"], nproc_per_node=2, world_size=4, dp=4, tp=1,
        store_host="127.0.0.1", store_port=1).to_json())
    for i, role in enumerate(["active", "active", "spare"]):
        etcd.put(keys.node_key(f"n{i}"), NodeRecord(
            node=f"n{i}", host="127.0.0.1", nproc=2, role=role, pid=100 + i,
            started_at=t0, lease_ttl_s=3).to_json())
    for i in range(2):
        etcd.put(keys.nodestatus_key(f"n{i}"), NodeStatus(
            node=f"n{i}", round=2, workers="running", step=30 + i, loss=2.5 + i,
            step_time_s=0.25, tokens_per_s=1024.0 * (1 + i), updated_at=time.time()).to_json())
    for step, good in ((10, True), (20, True), (30, False)):
        etcd.put(keys.checkpoint_key(step), CheckpointRecord(
            step=step, path=f"/ck/{step}", round=2, job_id="J1", committed_at=t0 + step,
            good=good).to_json())
    timeline = [(0, "job_accepted", "PENDING", {"id": "J1"}), (5, "round_started", "RENDEZVOUS", {}),
                (10, "running", "RUNNING", {}),
                (40, "fault_detected", "RECOVERING", {"kind": "worker_crash", "fault_at": t0 + 38}),
                (41, "round_started", "RENDEZVOUS", {}), (45, "running", "RUNNING", {}),
                (50, "recovered", "RUNNING", {"kind": "worker_crash"})]
    for dt, kind, state, fields in timeline:
        etcd.put(keys.event_key("test"), EventRecord(time=t0 + dt, kind=kind, message=kind,
                                                     state=state, fields=fields).to_json())


def _drain(stream, into: queue.Queue) -> None:
    """Move a stream's events into a queue, then how the stream ended: the RpcError that
    ended it, or None when it ended by itself (`_next` and `_ended` read them)."""
    try:
        for ev in stream:
            into.put(ev)
    except grpc.RpcError as e:
        into.put(e)
    else:
        into.put(None)


def _next(got: queue.Queue, timeout: float) -> pb.Event:
    """The stream's next event; a stream that ended instead fails the test, saying how."""
    item = got.get(timeout=timeout)
    assert isinstance(item, pb.Event), ("the stream ended", item and item.code(),
                                        item and item.details())
    return item


def _ended(got: queue.Queue, code: grpc.StatusCode, timeout: float = 10) -> None:
    """What is left in the stream is its end, with `code`: no event after those read."""
    item = got.get(timeout=timeout)
    assert isinstance(item, grpc.RpcError) and item.code() == code, (
        item if not isinstance(item, grpc.RpcError) else (item.code(), item.details()))


def _code(fn, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kw)
    return e.value.code(), e.value.details()


# -- reads -------------------------------------------------------------------------------------
def test_run_health_reports_progress_goodput_checkpoints_and_the_leader(etcd, keys, stub):
    t0 = time.time() - 100
    _populate(etcd, keys, t0=t0)
    h = stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=AUTH)
    assert (h.job_id, h.job_name, h.state, h.round, h.restarts) == ("J1", "api", "RUNNING", 2, 1)
    assert list(h.members) == ["n0", "n1"]
    assert (h.step, h.total_steps) == (31, 50)
    assert (h.loss, h.tokens_per_s, h.step_time_s) == (2.5, 1024.0, 0.25)  # rank 0's node
    # productive: running 10..38 (the fault happened at 38, seen at 40) + 50..now
    assert h.wall_time_s == pytest.approx(100, abs=10)  # accepted at t0, running now
    assert h.productive_time_s == pytest.approx(28 + h.wall_time_s - 50, abs=1e-3)
    assert h.goodput == pytest.approx(h.productive_time_s / h.wall_time_s)
    assert dict(h.nodes_by_state) == {"running": 2, "spare": 1}
    assert (h.last_checkpoint.step, h.last_checkpoint.good) == (30, False)
    assert h.last_good_checkpoint.step == 20
    assert not h.HasField("incident")
    assert (h.leader.id, h.leader.pid, h.leader.api) == ("leader-0", 4242, "h:7070")
    assert h.served_by == "standby-1" and not h.served_by_leader

    incident = {"kind": "node_lost", "culprit": "n1", "fault_at": t0 + 99,
                "detected_at": t0 + 99.5, "round": 2}
    etcd.put(keys.status, RunStatus(job_id="J1", state="RECOVERING", round=2,
                                    members=["n0", "n1"], reason="node(s) n1 lost",
                                    incident=incident).to_json())
    h = stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=AUTH)
    assert h.state == "RECOVERING"
    assert (h.incident.kind, h.incident.culprit, h.incident.round) == ("node_lost", "n1", 2)
    assert h.incident.reason == "node(s) n1 lost"


def test_run_health_without_a_run_or_with_garbage_records_still_answers(etcd, keys, stub):
    h = stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=AUTH)
    assert h.state == "" and h.goodput == -1 and not h.HasField("leader")
    etcd.put(keys.status, b"{not json")
    etcd.put(keys.node_key("bad"), b'{"node": "bad", "host": 1}')
    etcd.put(keys.nodestatus_key("n9"), dumps({"node": "n9", "step": 2**80}))
    etcd.put(keys.leader, b"[]")
    h = stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=AUTH)
    assert h.state == "" and h.leader.id == "(unreadable leader record)"
    assert list(stub.ListNodes(pb.ListNodesRequest(), metadata=AUTH).nodes) == []


def test_list_nodes_shows_roles_ranks_rates_cordons_and_lost_members(etcd, keys, stub):
    _populate(etcd, keys, t0=time.time() - 100)
    etcd.put(keys.cordon_key("n2"), b"{}")
    etcd.delete(keys.node_key("n1"))  # its lease expired
    nodes = {n.node: n for n in stub.ListNodes(pb.ListNodesRequest(), metadata=AUTH).nodes}
    assert set(nodes) == {"n0", "n1", "n2"}
    n0 = nodes["n0"]
    assert (n0.role, n0.state, list(n0.ranks), n0.step) == ("active", "running", [0, 1], 30)
    assert n0.step_rate == pytest.approx(4.0) and n0.lease_ttl_s == 3 and n0.pid == 100
    assert 0 <= n0.last_report_age_s < 60 and n0.registered_for_s >= 99
    assert (nodes["n1"].state, nodes["n1"].registered, list(nodes["n1"].ranks)) == ("lost", False, [2, 3])
    assert (nodes["n2"].state, nodes["n2"].cordoned, nodes["n2"].role) == ("cordoned", True, "spare")


def test_list_checkpoints_oldest_first_and_limited(etcd, keys, stub):
    _populate(etcd, keys, t0=time.time())
    all_ = stub.ListCheckpoints(pb.ListCheckpointsRequest(), metadata=AUTH).checkpoints
    assert [c.step for c in all_] == [10, 20, 30] and all_[0].path == "/ck/10"
    last = stub.ListCheckpoints(pb.ListCheckpointsRequest(limit=1), metadata=AUTH).checkpoints
    assert [c.step for c in last] == [30]


def test_watch_events_replays_from_a_revision_then_follows_with_a_kind_filter(etcd, keys, stub):
    _populate(etcd, keys, t0=time.time())
    replay = list(stub.WatchEvents(pb.WatchEventsRequest(), metadata=AUTH, timeout=10))
    assert [e.kind for e in replay] == ["job_accepted", "round_started", "running",
                                        "fault_detected", "round_started", "running", "recovered"]
    assert replay[3].fields["kind"] == "worker_crash"
    later = list(stub.WatchEvents(pb.WatchEventsRequest(start_revision=replay[5].revision),
                                  metadata=AUTH, timeout=10))
    assert [e.kind for e in later] == ["running", "recovered"]

    stream = stub.WatchEvents(pb.WatchEventsRequest(kinds=["recovered"], follow=True),
                              metadata=AUTH, timeout=30)
    got: queue.Queue = queue.Queue()
    threading.Thread(target=_drain, args=(stream, got), daemon=True).start()
    assert _next(got, timeout=10).kind == "recovered"  # the replayed one
    etcd.put(keys.event_key("test"), EventRecord(time=1, kind="fault_detected", message="x").to_json())
    etcd.put(keys.event_key("test"), EventRecord(time=2, kind="recovered", message="new").to_json())
    ev = _next(got, timeout=10)
    assert (ev.kind, ev.message) == ("recovered", "new")
    time.sleep(2 * api.STREAM_POLL_S)  # a follow stream goes on until its reader stops it
    stream.cancel()
    _ended(got, grpc.StatusCode.CANCELLED)


def test_event_streams_are_limited_and_a_cancelled_one_frees_its_slot(etcd, keys, stub):
    streams = [stub.WatchEvents(pb.WatchEventsRequest(follow=True), metadata=AUTH, timeout=30)
               for _ in range(2)]
    for s in streams:  # returns once the server has taken the stream on
        assert s.initial_metadata() is not None
    extra = stub.WatchEvents(pb.WatchEventsRequest(follow=True), metadata=AUTH, timeout=10)
    code, details = _code(lambda: next(extra))
    # the limit this server was given (max_streams=2), not the default's
    assert (code, details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                               "this daemon already serves 2 event streams")
    assert stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=AUTH, timeout=5) is not None
    streams[0].cancel()
    deadline = time.monotonic() + 10
    while True:  # the server notices the cancel within its poll period
        again = stub.WatchEvents(pb.WatchEventsRequest(), metadata=AUTH, timeout=10)
        try:
            list(again)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "a cancelled stream kept its slot"
            time.sleep(0.2)
    streams[1].cancel()


# -- commands ----------------------------------------------------------------------------------
def test_commands_write_the_documented_keys(etcd, keys, stub):
    _populate(etcd, keys, t0=time.time())
    r = stub.TriggerCheckpoint(pb.TriggerCheckpointRequest(reason="before upgrade"), metadata=AUTH)
    doc = json.loads(etcd.get(keys.checkpoint_request).value)
    assert doc["id"] == r.id and doc["reason"] == "before upgrade" and r.revision > 0

    stub.CordonNode(pb.CordonNodeRequest(node="n2"), metadata=AUTH)
    assert etcd.get(keys.cordon_key("n2")) is not None
    stub.UncordonNode(pb.UncordonNodeRequest(node="n2"), metadata=AUTH)
    assert etcd.get(keys.cordon_key("n2")) is None
    assert "not cordoned" in stub.UncordonNode(pb.UncordonNodeRequest(node="n2"),
                                               metadata=AUTH).message

    stub.DrainNode(pb.DrainNodeRequest(node="n1"), metadata=AUTH)
    assert etcd.get(keys.drain_key("n1")) is not None
    assert _code(stub.DrainNode, pb.DrainNodeRequest(node="n2"), metadata=AUTH)[0] == \
        grpc.StatusCode.FAILED_PRECONDITION  # a spare: nothing to drain
    code, details = _code(stub.CordonNode, pb.CordonNodeRequest(node="nope"), metadata=AUTH)
    assert code == grpc.StatusCode.NOT_FOUND and "nope" in details

    stub.PauseRun(pb.PauseRunRequest(), metadata=AUTH)
    assert etcd.get(keys.pause) is not None
    stub.ResumeRun(pb.ResumeRunRequest(), metadata=AUTH)
    assert etcd.get(keys.pause) is None

    code, details = _code(stub.CancelJob, pb.CancelJobRequest(job_id="other"), metadata=AUTH)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "J1" in details
    assert etcd.get(keys.cancel) is None
    stub.CancelJob(pb.CancelJobRequest(job_id="J1"), metadata=AUTH)
    assert json.loads(etcd.get(keys.cancel).value)["job_id"] == "J1"


def test_commands_without_an_active_run_are_refused(etcd, keys, stub):
    for call, req in ((stub.TriggerCheckpoint, pb.TriggerCheckpointRequest()),
                      (stub.PauseRun, pb.PauseRunRequest()), (stub.CancelJob, pb.CancelJobRequest())):
        code, details = _code(call, req, metadata=AUTH)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no run is active" in details
    assert etcd.get(keys.pause) is None and etcd.get(keys.cancel) is None


def test_submit_job_validates_before_writing(etcd, keys, stub):
    code, details = _code(stub.SubmitJob, pb.SubmitJobRequest(job_toml="[job\nnodes="),
                          metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "job_toml" in details
    code, details = _code(stub.SubmitJob, pb.SubmitJobRequest(job_toml=_job_toml(1, 2)),
                          metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "min_nodes" in details
    assert etcd.get(keys.job) is None
    reply = stub.SubmitJob(pb.SubmitJobRequest(job_toml=_job_toml()), metadata=AUTH)
    assert reply.job_id == "J1" and json.loads(etcd.get(keys.job).value)["nodes"] == 2
    etcd.put(keys.status, RunStatus(job_id="J1", state="RUNNING").to_json())
    code, details = _code(stub.SubmitJob, pb.SubmitJobRequest(job_toml=_job_toml()), metadata=AUTH)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "cancel it first" in details


@pytest.mark.parametrize("method,request_,field", [
    ("CordonNode", pb.CordonNodeRequest(node=""), "node"),
    ("CordonNode", pb.CordonNodeRequest(node="a/b"), "node"),
    ("DrainNode", pb.DrainNodeRequest(node="x" * 1000), "node"),
    ("UncordonNode", pb.UncordonNodeRequest(node="bell\x07"), "node"),
    ("ListCheckpoints", pb.ListCheckpointsRequest(limit=-1), "limit"),
    ("ListCheckpoints", pb.ListCheckpointsRequest(limit=2**31 - 1), "limit"),
    ("TriggerCheckpoint", pb.TriggerCheckpointRequest(reason="r" * 10_000), "reason"),
    ("PauseRun", pb.PauseRunRequest(reason="line\nbreak"), "reason"),
    ("SubmitJob", pb.SubmitJobRequest(job_toml=""), "job_toml"),
    ("CancelJob", pb.CancelJobRequest(job_id="j" * 500), "job_id"),
])
def test_out_of_range_fields_are_invalid_argument_naming_the_field(stub, method, request_, field):
    code, details = _code(getattr(stub, method), request_, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field + ":")


@pytest.mark.parametrize("request_,field", [
    (pb.WatchEventsRequest(start_revision=-5), "start_revision"),
    (pb.WatchEventsRequest(kinds=["k"] * 100), "kinds"),
    (pb.WatchEventsRequest(kinds=["k" * 65]), "kinds"),
])
def test_bad_event_stream_requests_are_invalid_argument(stub, request_, field):
    code, details = _code(lambda: list(stub.WatchEvents(request_, metadata=AUTH, timeout=5)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":")


# -- auth, TLS, fuzz ---------------------------------------------------------------------------
def test_missing_or_wrong_token_is_unauthenticated_for_calls_and_streams(etcd, keys, stub):
    for metadata in ([], [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
        code, _ = _code(stub.GetRunHealth, pb.GetRunHealthRequest(), metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _code(stub.CordonNode, pb.CordonNodeRequest(node="n0"), metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _code(lambda: list(stub.WatchEvents(pb.WatchEventsRequest(follow=True),
                                                      metadata=metadata, timeout=5)))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert etcd.get(keys.cordon_key("n0")) is None
    assert stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=AUTH) is not None


def test_half_open_calls_without_a_token_hold_no_thread_of_the_server(etcd, keys, roles):
    """An attacker opens calls without a token and never sends their request (HTTP/2 allows
    it: headers, then nothing): refused at once, they must not tie up the server's threads."""
    never = threading.Event()

    def nothing():  # a request stream that never yields, like a peer that never sends
        never.wait()
        return
        yield

    raw = dict(request_serializer=lambda m: m, response_deserializer=lambda b: b)
    with grpc.insecure_channel(roles) as attacker:
        calls = []
        for i in range(40):
            method = ["GetRunHealth", "CordonNode", "WatchEvents"][i % 3]
            path = f"/lazarus.v1.Lazarus/{method}"
            # the read-only token on a command is refused the same way
            metadata = READ if method == "CordonNode" and i % 2 else []
            if method == "WatchEvents":
                calls.append(attacker.stream_stream(path, **raw)(nothing(), metadata=metadata,
                                                                 timeout=30))
            else:
                calls.append(attacker.stream_unary(path, **raw).future(
                    nothing(), metadata=metadata, timeout=30))
        try:
            with grpc.insecure_channel(roles) as channel:
                stub = pb_grpc.LazarusStub(channel)
                t = time.monotonic()
                assert stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=AUTH,
                                         timeout=5) is not None
                assert time.monotonic() - t < 5
            for call in calls:
                assert call.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.PERMISSION_DENIED)
        finally:
            never.set()


def test_a_follow_stream_that_is_not_read_ends_once_its_inbox_is_full(etcd, keys, stub,
                                                                       monkeypatch):
    """A watcher that follows and never reads: the events pile up on the daemon for it only
    until MAX_INBOX_EVENTS, then its stream ends RESOURCE_EXHAUSTED naming where to resume."""
    monkeypatch.setattr(api, "MAX_INBOX_EVENTS", 20, raising=False)  # before: none
    etcd.put(keys.event_key("test"), EventRecord(time=0, kind="first", message="x").to_json())
    stream = stub.WatchEvents(pb.WatchEventsRequest(follow=True), metadata=AUTH, timeout=60)
    first = next(stream)
    assert first.kind == "first"
    # Large events fill the transport's flow-control windows, so the server's stream blocks
    # on its send and the watch keeps filling its inbox.
    big = "y" * 200_000
    for i in range(200):
        etcd.put(keys.event_key("test"), EventRecord(time=i, kind="big", message=big).to_json())
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for ev in stream:
            got.append(ev)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "start_revision" in e.value.details()
    resume = int(e.value.details().split("start_revision ")[1].split()[0])
    assert resume == (got[-1].revision if got else first.revision) + 1
    assert len(got) < 200
    # where it says, the rest comes
    rest = list(stub.WatchEvents(pb.WatchEventsRequest(start_revision=resume), metadata=AUTH,
                                 timeout=30))
    assert len(got) + len(rest) == 200


def test_a_read_only_token_reads_everything_and_changes_nothing(etcd, keys, roles):
    _populate(etcd, keys, t0=time.time())
    before = etcd.get_prefix(keys.root).kvs
    with grpc.insecure_channel(roles) as ch:
        stub = pb_grpc.LazarusStub(ch)
        nodes = stub.ListNodes(pb.ListNodesRequest(), metadata=READ, timeout=10)
        assert [n.node for n in nodes.nodes] == ["n0", "n1", "n2"]
        assert stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=READ).job_id == "J1"
        assert len(stub.ListCheckpoints(pb.ListCheckpointsRequest(), metadata=READ)
                   .checkpoints) == 3
        assert len(list(stub.WatchEvents(pb.WatchEventsRequest(), metadata=READ,
                                         timeout=10))) == 7
        code, details = _code(stub.DrainNode, pb.DrainNodeRequest(node="n0"), metadata=READ)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details.startswith("DrainNode needs the admin token; this token is read-only")
        # every other RPC is a command: each refused before its request is parsed
        for path, streaming in _service_methods():
            method = path.rpartition("/")[2]
            if method in api.READ_METHODS:
                continue
            call = ch.unary_stream(path) if streaming else ch.unary_unary(path)
            code, details = _code(lambda: call(b"\xff garbage", metadata=READ, timeout=10))
            assert code == grpc.StatusCode.PERMISSION_DENIED, method
            needs = "the submit or admin token" if method in api.SUBMIT_METHODS else \
                "the admin token"
            assert details.startswith(f"{method} needs {needs}; this token is read-only"), details
        assert etcd.get_prefix(keys.root).kvs == before  # nothing written
        # the admin token may do it all
        assert "draining n0" in stub.DrainNode(pb.DrainNodeRequest(node="n0"),
                                               metadata=AUTH).message
        code, _ = _code(stub.ListNodes, pb.ListNodesRequest(),
                        metadata=[("authorization", "Bearer neither")])
        assert code == grpc.StatusCode.UNAUTHENTICATED


def test_the_read_only_token_must_differ_from_the_admin_token(etcd, keys):
    with pytest.raises(api.UserError, match="the read-only token is the admin token"):
        api.serve(etcd, keys, address="127.0.0.1:0", token=TOKEN, read_token=TOKEN)
    with pytest.raises(api.UserError, match="a read-only token needs an admin token"):
        api.serve(etcd, keys, address="127.0.0.1:0", read_token=READ_TOKEN)


def test_a_daemon_serves_both_roles_to_the_cli(etcd, keys, tmp_path):
    """A real `lazarus daemon`: the admin token from $LAZARUS_TOKEN, the read-only one from
    --read-token-file; the CLI, as an operator types it, with whichever token it holds."""
    _populate(etcd, keys, t0=time.time())
    read_file = tmp_path / "read-token"
    read_file.write_text(READ_TOKEN + "\n")
    read_file.chmod(0o600)  # a token file others may read is refused
    endpoint = tmp_path / "endpoint.json"
    env = {**os.environ, "LAZARUS_TOKEN": TOKEN}
    env.pop("LAZARUS_READ_TOKEN", None)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "lazarus.cli", "daemon", "--etcd", etcd.endpoint, "--root",
         keys.root, "--api", "127.0.0.1:0", "--read-token-file", str(read_file),
         "--endpoint-file", str(endpoint), "--data-dir", str(tmp_path / "data")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not endpoint.exists():
            assert daemon.poll() is None, daemon.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        address = json.loads(endpoint.read_text())["addresses"][0]

        def cli(*argv: str, token: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "lazarus.cli", *argv, "--address", address],
                env={**os.environ, "LAZARUS_TOKEN": token}, capture_output=True, text=True,
                timeout=60)

        nodes = cli("nodes", "--json", token=READ_TOKEN)
        assert nodes.returncode == 0, nodes.stderr
        assert [n["node"] for n in json.loads(nodes.stdout)["nodes"]] == ["n0", "n1", "n2"]
        drain = cli("drain", "n0", token=READ_TOKEN)
        assert drain.returncode == client.EXIT_AUTH and drain.stdout == ""
        assert drain.stderr == (f"lazarus drain: error: the daemon at {address} refused: "
                                "DrainNode needs the admin token; this token is read-only (it "
                                "may call GetRunHealth, ListCheckpoints, ListNodes, "
                                "WatchEvents)\n")
        assert etcd.get(keys.drain_key("n0")) is None
        drain = cli("drain", "n0", token=TOKEN)
        assert drain.returncode == 0 and "draining n0" in drain.stdout, drain.stderr
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)


def _service_methods() -> list[tuple[str, bool]]:
    service = pb.DESCRIPTOR.services_by_name["Lazarus"]
    return [(f"/lazarus.v1.Lazarus/{m.name}", m.server_streaming) for m in service.methods]


def test_random_bytes_and_oversized_requests_never_take_the_server_down(etcd, keys, server, stub):
    _populate(etcd, keys, t0=time.time())
    rng = random.Random(4)
    # what a handler may answer; gRPC's own two answers are told apart below
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
               grpc.StatusCode.FAILED_PRECONDITION}

    def follows(payload: bytes) -> bool:
        try:
            return pb.WatchEventsRequest.FromString(payload).follow
        except Exception:  # protobuf's DecodeError: not a request at all
            return False

    seen = set()
    with grpc.insecure_channel(server, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        for path, streaming in _service_methods():
            # No serializers: the bytes go on the wire as they are.
            call = ch.unary_stream(path) if streaming else ch.unary_unary(path)
            payloads = [rng.randbytes(rng.randint(0, 300)) for _ in range(25)]
            payloads += [b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 10]
            for payload in payloads:
                try:
                    out = call(payload, metadata=AUTH, timeout=0.5 if streaming else 5)
                    if streaming:
                        list(out)
                    seen.add(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.INTERNAL:
                        # gRPC could not parse the request; a handler never answers INTERNAL
                        assert e.details() == "Exception deserializing request!", (path, payload)
                    elif e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        # only a follow stream runs until its deadline; any other call ends
                        assert streaming and follows(payload), (path, payload)
                    else:
                        assert e.code() in allowed, (path, payload, e.code(), e.details())
                    seen.add(e.code())
            code, _ = _code(lambda: list(call(b"\x0a" + b"\x00" * (2 << 20), metadata=AUTH,
                                              timeout=5)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the size limit
    assert grpc.StatusCode.INTERNAL in seen and grpc.StatusCode.OK in seen
    # random but well-formed field values
    for _ in range(60):
        chars = (rng.choice([rng.randint(0, 0x7f), rng.randint(0xe000, 0x10ffff)])
                 for _ in range(rng.randint(0, 40)))  # ASCII incl. control chars, non-BMP
        text = "".join(map(chr, chars))
        for fn, req in ((stub.CordonNode, pb.CordonNodeRequest(node=text)),
                        (stub.DrainNode, pb.DrainNodeRequest(node=text)),
                        (stub.SubmitJob, pb.SubmitJobRequest(job_toml=text)),
                        (stub.TriggerCheckpoint, pb.TriggerCheckpointRequest(reason=text))):
            try:
                fn(req, metadata=AUTH, timeout=5)
            except grpc.RpcError as e:
                assert e.code() in allowed, (req, e.code(), e.details())
    h = stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=AUTH, timeout=5)
    assert h.job_id == "J1"


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_certs(d):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", f"{name}.pem",
                 cwd=d)


def test_mutual_tls_admits_only_clients_with_a_certificate(etcd, keys, tmp_path):
    _make_certs(tmp_path)
    srv, port = api.serve(etcd, keys, address="127.0.0.1:0", token=TOKEN,
                          tls_cert=str(tmp_path / "server.pem"),
                          tls_key=str(tmp_path / "server.key"),
                          client_ca=str(tmp_path / "ca.pem"))
    try:
        ca = (tmp_path / "ca.pem").read_bytes()
        good = grpc.ssl_channel_credentials(ca, (tmp_path / "client.key").read_bytes(),
                                            (tmp_path / "client.pem").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", good) as ch:
            h = pb_grpc.LazarusStub(ch).GetRunHealth(pb.GetRunHealthRequest(), metadata=AUTH,
                                                     timeout=10)
            assert h.goodput == -1
        with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca)) as ch:
            code, _ = _code(pb_grpc.LazarusStub(ch).GetRunHealth, pb.GetRunHealthRequest(),
                            metadata=AUTH, timeout=10)
            assert code == grpc.StatusCode.UNAVAILABLE  # the handshake fails
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            code, _ = _code(pb_grpc.LazarusStub(ch).GetRunHealth, pb.GetRunHealthRequest(),
                            metadata=AUTH, timeout=10)
            assert code == grpc.StatusCode.UNAVAILABLE
        # the CLI over TLS, trusting the CA
        rc = client.status_main(["--address", f"127.0.0.1:{port}", "--token", TOKEN, "--json",
                                 "--tls-ca", str(tmp_path / "ca.pem"),
                                 "--tls-cert", str(tmp_path / "client.pem"),
                                 "--tls-key", str(tmp_path / "client.key")])
        assert rc == 0
    finally:
        srv.stop(grace=0).wait()


def test_a_taken_port_is_a_user_error_not_a_shared_socket(etcd, keys, server):
    with pytest.raises(api.UserError, match="cannot listen"):
        api.serve(etcd, keys, address=server, token=TOKEN)


# -- the CLI against the server ----------------------------------------------------------------
def _cli(capsys, main, *argv, address, token=TOKEN):
    rc = main(["--address", address, "--token", token, *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_tables_and_json(etcd, keys, server, capsys):
    _populate(etcd, keys, t0=time.time() - 100)
    rc, out, _ = _cli(capsys, client.status_main, address=server)
    assert rc == 0
    assert "api (J1)  RUNNING" in out and "31/50" in out and "running 2, spare 1" in out
    assert "step 30 (not yet good)" in out and f"{server} (standby standby-1)" in out
    rc, out, _ = _cli(capsys, client.status_main, "--json", address=server)
    doc = json.loads(out)
    assert rc == 0 and doc["state"] == "RUNNING" and doc["step"] == "31"  # int64 as a string
    assert doc["nodes_by_state"] == {"running": "2", "spare": "1"}

    rc, out, _ = _cli(capsys, client.nodes_main, address=server)
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["NODE", "ROLE", "STATE", "RANKS"]
    assert lines[1].split()[:5] == ["n0", "active", "running", "0,1", "30"]
    assert lines[3].split()[:3] == ["n2", "spare", "spare"]
    rc, out, _ = _cli(capsys, client.nodes_main, "--json", address=server)
    assert [n["node"] for n in json.loads(out)["nodes"]] == ["n0", "n1", "n2"]

    rc, out, _ = _cli(capsys, client.checkpoints_main, "--limit", "2", address=server)
    assert [line.split()[0] for line in out.splitlines()] == ["STEP", "20", "30"]

    rc, out, _ = _cli(capsys, client.events_main, "--kind", "fault_detected", "--json",
                      address=server)
    evs = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and [e["kind"] for e in evs] == ["fault_detected"]
    # an event's revision + 1 resumes after it
    rc, out, _ = _cli(capsys, client.events_main, "--json", address=server)
    every = [json.loads(line) for line in out.splitlines()]
    assert len(every) > 2
    rc, out, _ = _cli(capsys, client.events_main, "--since-revision",
                      str(int(every[0]["revision"]) + 1), "--json", address=server)
    assert rc == 0 and [json.loads(line) for line in out.splitlines()] == every[1:]

    rc, out, _ = _cli(capsys, client.cordon_main, "n2", address=server)
    assert rc == 0 and out.strip() == "cordoned n2: it takes no new work"
    rc, out, err = _cli(capsys, client.drain_main, "ghost", address=server)
    assert rc == client.EXIT_REFUSED and out == "" and err.count("\n") == 1 and "ghost" in err
    rc, out, err = _cli(capsys, client.cordon_main, "a/b", address=server)
    assert rc == client.EXIT_USAGE and "node:" in err
    rc, out, err = _cli(capsys, client.checkpoint_main, "now", "--json", address=server)
    assert rc == 0 and json.loads(out)["id"]
    rc, out, err = _cli(capsys, client.checkpoint_main, "now", "--reason", "before upgrade",
                        address=server)
    assert rc == 0 and out.startswith("checkpoint requested (id ")
    assert json.loads(etcd.get(keys.checkpoint_request).value)["reason"] == "before upgrade"


def test_cli_wrong_token_and_dead_daemon_are_one_line_each(server, capsys):
    rc, out, err = _cli(capsys, client.status_main, address=server, token="wrong")
    assert rc == client.EXIT_AUTH and out == ""
    assert err.count("\n") == 1 and "refused the token" in err
    rc, out, err = _cli(capsys, client.status_main, address="127.0.0.1:1")
    assert rc == client.EXIT_UNREACHABLE and err.count("\n") == 1
    assert "cannot reach the daemon at 127.0.0.1:1" in err


def test_cli_finds_the_daemon_through_the_endpoint_file(etcd, keys, server, tmp_path,
                                                        monkeypatch, capsys):
    from lazarus.core import endpoint_file
    monkeypatch.setenv("LAZARUS_HOME", str(tmp_path))
    monkeypatch.delenv("LAZARUS_ADDRESS", raising=False)
    monkeypatch.delenv("LAZARUS_TOKEN", raising=False)
    _populate(etcd, keys, t0=time.time())
    # the first address is dead (a killed leader): the next one answers
    endpoint_file.write(endpoint_file.default_path(), endpoint_file.Endpoint(
        addresses=["127.0.0.1:1", server], token=TOKEN, pid=os.getpid()))
    assert os.stat(endpoint_file.default_path()).st_mode & 0o077 == 0
    assert client.status_main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job_id"] == "J1"
    endpoint_file.remove_if_mine(endpoint_file.default_path(), os.getpid())
    assert client.status_main([]) == client.EXIT_UNREACHABLE
    assert "no daemon known" in capsys.readouterr().err


# -- a real cluster --------------------------------------------------------------------------
def test_a_real_fault_reaches_watchers_through_the_daemons_api(tmp_path):
    from lazarus.core import jobspec
    from lazarus.sim.localcluster import LocalCluster
    from tests.e2e.helpers import wait_for

    metrics = tmp_path / "metrics.jsonl"
    with LocalCluster(tmp_path / "cluster", lease_ttl_s=3) as cluster:
        cluster.start_etcd()
        cluster.start_daemon()
        cluster.start_daemon()
        for node in ("n0", "n1"):
            cluster.start_agent(node, nproc=1, role="active")
        cluster.submit(jobspec.from_dict(
            {"job": {"name": "api-e2e", "nodes": 2, "min_nodes": 1, "nproc_per_node": 1},
             # far more than the test watches: the run must still go on when the standby's
             # first read (seconds on a busy machine) and the crash come
             "train": {"steps": 400, "metrics": str(metrics), "model": {"name": "tiny"},
                       "optimizer": {"warmup_steps": 4},
                       "data": {"global_batch": 8, "seq_len": 64},
                       "checkpoint": {"every": 4, "dir": str(cluster.workdir / "ckpt")}}},
            source="test"))
        auth = [("authorization", f"Bearer {cluster.token}")]
        address = cluster.api_addresses[1]  # whichever leads, this one answers
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.LazarusStub(ch)
            wait_for(cluster, lambda st: st.status and st.status.state == "RUNNING"
                     and any(ns.step >= 6 for ns in st.node_status.values()),
                     timeout=180, what="the run to reach step 6")
            # A standby's first read parses the job, which imports torch (seconds, on a busy
            # machine): a generous deadline for this first call.
            start = stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=auth, timeout=90)
            assert start.state == "RUNNING" and start.leader.api in cluster.api_addresses
            stream = stub.WatchEvents(pb.WatchEventsRequest(
                start_revision=start.revision + 1, follow=True,
                kinds=["fault_detected", "recovered"]), metadata=auth, timeout=120)
            got: queue.Queue = queue.Queue()
            threading.Thread(target=_drain, args=(stream, got), daemon=True).start()
            # the fault, as an operator types it beside `lazarus up` (whose workdir this
            # cluster's is like): its TLS etcd, user and nodes found from the workdir alone
            pid = cluster.state().node_status["n1"].pids[-1]
            hit = subprocess.run([sys.executable, "-m", "lazarus.cli", "chaos", "kill-worker",
                                  "--node", "n1", "--workdir", str(cluster.workdir)],
                                 capture_output=True, text=True, timeout=60)
            assert (hit.returncode, hit.stdout) == (0, f"kill-worker: killed pid {pid}\n"), \
                hit.stderr
            detected = _next(got, timeout=60)
            recovered = _next(got, timeout=90)
            stream.cancel()
            _ended(got, grpc.StatusCode.CANCELLED)
            assert (detected.kind, detected.fields["culprit"]) == ("fault_detected", "n1"), hit
            assert recovered.kind == "recovered" and recovered.fields["kind"] == "worker_crash"
            after = stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=auth, timeout=10)
            assert after.restarts == 1 and 0 < after.goodput < 1
        # and the CLI, as a separate process, as an operator would type it
        proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "status", "--address",
                               address, "--token-file", str(cluster.token_file)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "api-e2e" in proc.stdout, proc.stderr

        # `lazarus events --follow` in one terminal, `lazarus cancel` in another: the follow
        # prints the cancel as it happens, the run ends CANCELLED and its ranks stop.
        def cli(*argv: str) -> list[str]:
            return [sys.executable, "-m", "lazarus.cli", *argv, "--address", address,
                    "--token-file", str(cluster.token_file)]

        follow = subprocess.Popen(cli("events", "--follow", "--kind", "cancelled", "--json"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        followed: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [followed.put(line) for line in follow.stdout],
                         daemon=True).start()
        try:
            wrong = subprocess.run(cli("cancel", "--job-id", "not-this-run"),
                                   capture_output=True, text=True, timeout=60)
            assert wrong.returncode == client.EXIT_REFUSED and wrong.stdout == "", wrong.stderr
            assert f"job not-this-run is not the current run (that is {after.job_id})" \
                in wrong.stderr
            cancel = subprocess.run(cli("cancel", "--job-id", after.job_id),
                                    capture_output=True, text=True, timeout=60)
            assert (cancel.returncode, cancel.stdout) == (0, f"cancelling run {after.job_id}\n"), \
                cancel.stderr
            event = json.loads(followed.get(timeout=60))
            assert event["kind"] == "cancelled" and "cancelled by the operator" in event["message"]
            assert follow.poll() is None  # --follow keeps watching after it
        finally:
            follow.terminate()
            follow.wait(timeout=30)
        st = wait_for(cluster, lambda st: st.status and st.status.state == "CANCELLED"
                      and all(st.node_status[n].workers != "running" for n in ("n0", "n1"))
                      and st, timeout=60, what="CANCELLED with its ranks stopped")
        assert st.status.reason == "cancelled by the operator"


def test_list_nodes_carries_each_monitors_verdict(etcd, keys, stub):
    _populate(etcd, keys, t0=time.time() - 100)
    sick = {"state": "failed",
            "gpu": {"backend": "sim", "state": "failed",
                    "gpus": [{"index": 0, "state": "failed",
                              "reasons": ["Xid 79: GPU fell off the bus"]}]},
            "host": {"state": "healthy", "reasons": []}}
    etcd.put(keys.nodestatus_key("n0"), dumps({"node": "n0", "round": 2, "workers": "running",
                                               "step": 30, "health": sick}))
    nodes = {n.node: n for n in stub.ListNodes(pb.ListNodesRequest(), metadata=AUTH).nodes}
    verdicts = {v.monitor: (v.state, list(v.reasons)) for v in nodes["n0"].health}
    assert verdicts == {"gpu": ("failed", ["gpu0: Xid 79: GPU fell off the bus"]),
                        "host": ("healthy", [])}


def test_list_nodes_names_a_straggler_across_nodes(etcd, keys, stub):
    from lazarus.core.throughput import ThroughputTracker
    _populate(etcd, keys, t0=time.time() - 100)
    for i, compute_s in enumerate((0.1, 0.3)):   # n1's ranks work 3x as long as n0's
        tr = ThroughputTracker()
        for step in range(11, 31):
            for rank in (2 * i, 2 * i + 1):
                tr.observe(rank=rank, step=step, step_time_s=0.35, tokens=256,
                           compute_s=compute_s)
        etcd.put(keys.nodestatus_key(f"n{i}"), NodeStatus(
            node=f"n{i}", round=2, workers="running", step=30, throughput=tr.summary(),
            updated_at=time.time()).to_json())
    nodes = {n.node: n for n in stub.ListNodes(pb.ListNodesRequest(), metadata=AUTH).nodes}
    verdicts = {n: {v.monitor: (v.state, list(v.reasons)) for v in nodes[n].health}
                for n in ("n0", "n1")}
    assert verdicts["n0"] == {"throughput": ("healthy", [])}
    state, (reason,) = verdicts["n1"]["throughput"]
    assert state == "degraded" and "3.00x slower than its peers in 20 of the last 20" in reason

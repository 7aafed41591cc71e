"""Whatever a value under our keys holds, reading it is total: a record or a RecordError, never
anything else (a RecursionError from deep JSON once crash-looped the leader and every standby).
And one bad value costs the daemon that key only: the view, decide(), the executor, the API's
replies and the incident traces all go on with it left out, and whatever the daemon then
writes it can read back.

Values are fuzzed with hypothesis: random bytes, random JSON, JSON nested thousands deep,
numbers past 64 bits, NaN and infinities, lone surrogates, and valid records with one value
anywhere in them replaced by any of those, by a value of another type, or deleted. And an
agent's huge report is not copied whole into the leader's transaction, which etcd would
refuse at every pass."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import metrics, trace

from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.core.records import (RENDEZVOUS, RUNNING, CheckpointRecord, EventRecord, Keys,
                                  NodeRecord, NodeStatus, RecordError, RoundRecord, RunStatus,
                                  load_json)
from lazarus.daemon import executor, health
from lazarus.daemon.actions import Emit, SetStatus, StartRound
from lazarus.daemon.decide import decide
from lazarus.daemon.telemetry import IncidentTracer
from lazarus.daemon.view import parse

NOW = 10_000.0
KEYS = Keys("/fuzz/")
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- values -----------------------------------------------------------------------------------

_HOLE = "\x00hole\x00"  # where a raw JSON text goes into a dumped document
_ODD_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1e-400", str(2**63),
                str(-2**63), str(2**63 - 1), "9" * 5000, "1e300", "-0.0", "0"]
_ANY_CHAR = st.characters(codec=None, exclude_categories=())  # lone surrogates included

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62)
           | st.floats() | st.text(_ANY_CHAR, max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(_ANY_CHAR, max_size=8), inner, max_size=4),
                           max_leaves=12)


@st.composite
def deep(draw) -> str:
    depth = draw(st.integers(min_value=20, max_value=20_000))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}"), ('[{"k":', "}]")]))
    return opener * depth + draw(st.sampled_from(["1", "null", '"x"'])) + closer * depth


def _dump(value) -> str:
    return json.dumps(value)  # NaN and infinities as Python writes them; surrogates escaped


# What a field of another type holds, at the edges: where a reader indexes, iterates or adds.
_WRONG = ["null", "0", "-1", str(2**63 - 1), str(-2**63 + 1), "1e300", "NaN", '""', "[]", "{}",
          "[1]", '["a"]', '{"a": 1}', "true", "[[1, 2]]", '{"0": [1]}', '"' + "x" * 5000 + '"']
json_texts = (json_values.map(_dump) | deep() | st.sampled_from(_ODD_NUMBERS)
              | st.sampled_from(['"\\ud800"', '{"\\udfff": 1}', '"a\\u0000b"']))


def _holed(doc, path, *, delete=None) -> str:
    """`doc` dumped with the value at `path` replaced by _HOLE (with `delete`, that key of the
    dict at path[:-1] left out instead)."""
    doc = copy.deepcopy(doc)
    node = doc
    for k in path[:-1]:
        node = node[k]
    if delete is not None:
        del node[delete]
    else:
        node[path[-1]] = _HOLE
    return _dump(doc)


def _paths(doc, prefix=()) -> list[tuple]:
    """Every place in `doc` a value sits (a list's first two only: long ones would swamp the
    rest)."""
    items = (doc.items() if isinstance(doc, dict)
             else enumerate(doc[:2]) if isinstance(doc, list) else ())
    out = []
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


@st.composite
def mutated(draw, doc) -> bytes:
    """`doc` with one value anywhere in it (each place as likely) replaced by any JSON text, or
    one key deleted."""
    paths = _paths(doc)
    if not paths:
        return draw(json_texts).encode()
    path = draw(st.sampled_from(paths))
    node = doc
    for k in path[:-1]:
        node = node[k]
    if isinstance(node, dict) and draw(st.integers(0, 5)) == 0:
        return _holed(doc, (*path[:-1], None), delete=path[-1]).encode()
    new = draw(_like(node[path[-1]]) | st.sampled_from(_WRONG) | json_texts)
    return _holed(doc, path).replace(_dump(_HOLE), new).encode()


def _like(value) -> st.SearchStrategy[str]:
    """A JSON value of the same kind as `value`, at its extremes: what passes a type check."""
    if isinstance(value, bool):
        return st.booleans().map(_dump)
    if isinstance(value, int):
        return st.integers(min_value=-2**63 + 1, max_value=2**63 - 1).map(_dump)
    if isinstance(value, float):
        return st.floats().map(_dump)
    if isinstance(value, str):
        return st.text(_ANY_CHAR, max_size=300).map(_dump)
    if isinstance(value, list):
        return st.lists(json_values, max_size=6).map(_dump)
    return st.dictionaries(st.text(max_size=8), json_values, max_size=6).map(_dump)


def values(doc) -> st.SearchStrategy[bytes]:
    """What might sit under a key whose record is `doc`: mostly that record with one value
    changed (what gets past the JSON and the outer checks), else anything."""
    return st.one_of(mutated(doc), mutated(doc), mutated(doc), st.binary(max_size=64),
                     json_texts.map(str.encode),
                     st.sampled_from([b"", b"\xff\xfe{}", "{}".encode("utf-16"), b"\x00"]))


# -- valid records: the base every mutation starts from ------------------------------------

def _job() -> jobspec.JobSpec:
    return jobspec.from_dict({"job": {"name": "t", "nodes": 2, "min_nodes": 1,
                                      "nproc_per_node": 1, "id": "J", "max_restarts": 5},
                              "train": {"steps": 100, "model": {"name": "tiny"},
                                        "data": {"global_batch": 4},
                                        "checkpoint": {"dir": "/c"}},
                              "policy": {"max_spikes": 2}}, source="test")


_HANG = {"culprits": [1], "reason": "stalled", "stalled_s": 12.0, "timeout_s": 10.0,
         "at": NOW - 1, "stacks": "/w/x.txt",
         "positions": {"0": {"step": 9, "phase": "collective", "seq": 4, "stalled_s": 12.0,
                             "op": "all_reduce"},
                       "1": {"step": 9, "phase": "forward", "seq": 3, "stalled_s": 12.0,
                             "op": ""}}}
_INCIDENT = {"kind": "worker_crash", "culprit": "b", "fault_at": NOW - 30,
             "detected_at": NOW - 29, "round": 1}
_THROUGHPUT = {"ranks": {"0": {"work_s": [0.1, 0.1, 0.2], "p50_s": 0.1}},
               "tokens_per_s": 100.0, "p50_s": 0.1}


def _status(node: str, variant: str, **kw) -> NodeStatus:
    sick = variant == "recovered"
    spikes = {"a": 11, "b": 12} if variant == "spikes" else {"a": 11}
    kw = {"workers": "running", **kw}
    return NodeStatus(node=node, round=2, step=12, loss=2.5,
                      step_time_s=0.1, exit_codes={"0": 1}, pids=[10, 11], updated_at=NOW - 1,
                      spikes=[{"step": spikes[node], "window": [40, 43], "loss": float("nan"),
                               "reason": "loss_spike"}] if node in spikes else [],
                      window=[44, 47], throughput=_THROUGHPUT,
                      health={"state": "degraded" if sick else "healthy",
                              "gpu": {"state": "degraded" if sick else "healthy", "gpus": [
                                  {"index": 0, "state": "degraded", "reasons": ["ECC"]}]},
                              "host": {"state": "healthy", "reasons": []}},
                      long_phase={"since": 0.0, "until": NOW - 100}, **kw)


# What decide() is in the middle of, so that a bad value meets each of its paths: an incident
# recovered (and a degraded GPU, a host alert to clear), loss spikes to roll back, a hang
# report, a worker crash in a rendezvous, a job to accept.
VARIANTS = ("recovered", "spikes", "hang", "crash", "accept")


def base(variant: str) -> dict[str, bytes]:
    job = _job().to_json()
    crashed = {"workers": "failed", "failed_rank": 0, "fault_at": NOW - 2}
    raw = {
        KEYS.job: job, KEYS.accepted_job: job,
        KEYS.status: RunStatus(job_id="J", state=RENDEZVOUS if variant == "crash" else RUNNING,
                               round=2, members=["a", "b"], since=NOW - 20, restore="/c/4",
                               restore_step=4,
                               incident=_INCIDENT if variant == "recovered" else None,
                               skip_windows=[[1, 3]],
                               stragglers={"b": {"round": 1, "reason": "slow"}},
                               host_alerts={"a": ["disk"]} if variant == "recovered" else {},
                               ).to_json(),
        KEYS.round: b"2",
        KEYS.leader: json.dumps({"id": "d0", "pid": 7, "host": "h", "api": "h:1"}).encode(),
        KEYS.round_key(2): RoundRecord(round=2, job_id="J", members=["a", "b"],
                                       nproc_per_node=1, world_size=2, dp=2, tp=1,
                                       store_host="127.0.0.1", store_port=9, restore="/c/4",
                                       restore_step=4,
                                       train=_job().train_config_for(2)).to_json(),
        **{KEYS.node_key(n): NodeRecord(node=n, host="127.0.0.1", nproc=1, role=role,
                                        store_port=9, started_at=NOW - 60).to_json()
           for n, role in (("a", "active"), ("b", "active"), ("s", "spare"))},
        KEYS.nodestatus_key("a"): _status(
            "a", variant, hang=_HANG if variant == "hang" else None).to_json(),
        KEYS.nodestatus_key("b"): _status(
            "b", variant, **(crashed if variant == "crash" else {})).to_json(),
        KEYS.checkpoint_key(4): CheckpointRecord(step=4, path="/c/4", round=1, job_id="J",
                                                 committed_at=NOW - 50).to_json(),
        KEYS.claim_key(6): CheckpointRecord(step=6, path="/c/step-00000006", round=2,
                                            job_id="J", committed_at=NOW - 1).to_json(),
        KEYS.events + f"{1:020d}-w": EventRecord(
            time=NOW - 29, kind="fault_detected", message="m", round=1, state="RECOVERING",
            fields=_INCIDENT).to_json(),
        KEYS.events + f"{2:020d}-w": EventRecord(
            time=NOW - 25, kind="round_started", message="m", round=2, state="RENDEZVOUS",
            fields={"members": ["a", "b"], "restore_step": 4}).to_json(),
        KEYS.events + f"{3:020d}-w": EventRecord(
            time=NOW - 5, kind="recovered", message="m", round=2, state=RUNNING,
            fields={**_INCIDENT, "recovered_at": NOW - 5, "first_step": 5}).to_json(),
    }
    if variant == "accept":
        for key in (KEYS.status, KEYS.accepted_job, KEYS.round_key(2)):
            del raw[key]
    return raw


# Every key kind the daemon reads, with the record that normally sits there (None: the key's
# presence is what counts, its value is free).
_PRESENT = {KEYS.drain_key("b"): {"requested_at": 1.0, "reason": "x"},
            KEYS.pause: {"requested_at": 1.0},
            KEYS.cancel: {"requested_at": 1.0, "job_id": "other"},
            KEYS.checkpoint_request: {"id": "c1", "requested_at": 1.0},
            KEYS.cordon_key("s"): "drained",
            KEYS.root + "torchrun/r/state": "pickled"}
KEY_KINDS = sorted(set(base("recovered")) | set(_PRESENT))


def _doc(key: str, raw: dict[str, bytes]):
    if key in _PRESENT or key == KEYS.round:
        return _PRESENT.get(key, 2)
    return json.loads(base("recovered")[key] if key not in raw else raw[key])


# -- the properties --------------------------------------------------------------------------

RECORDS = [(RunStatus, KEYS.status), (RoundRecord, KEYS.round_key(2)),
           (NodeRecord, KEYS.node_key("a")), (NodeStatus, KEYS.nodestatus_key("a")),
           (CheckpointRecord, KEYS.checkpoint_key(4)), (EventRecord, KEYS.events + f"{3:020d}-w"),
           (jobspec.JobSpec, KEYS.job)]


@st.composite
def record_values(draw):
    cls, key = draw(st.sampled_from(RECORDS))
    variant = draw(st.sampled_from(VARIANTS[:-1]))
    return cls, draw(values(json.loads(base(variant)[key])))


@FUZZ
@given(record_values())
def test_every_record_parse_returns_a_record_or_raises_record_error(case):
    cls, raw = case
    try:
        rec = cls.from_json(raw)
    except RecordError:
        return
    # what was read can be written and read again (the daemon copies records it changes)
    assert type(cls.from_json(rec.to_json())) is cls


@FUZZ
@given(json_texts.map(str.encode) | st.binary(max_size=64))
def test_load_json_returns_a_value_or_raises_record_error(raw):
    try:
        load_json(raw, "x")
    except RecordError:
        pass


@st.composite
def one_bad_key(draw):
    raw = base(draw(st.sampled_from(VARIANTS)))
    key = draw(st.sampled_from(KEY_KINDS))
    raw[key] = draw(values(_doc(key, raw)))
    return key, raw


def _snapshot(raw: dict[str, bytes], lease: int = 0) -> E.Snapshot:
    return E.Snapshot(revision=100, kvs={k: E.KV(key=k, value=v, create_revision=1,
                                                 mod_revision=10 + i, version=1, lease=lease)
                                         for i, (k, v) in enumerate(sorted(raw.items()))})


@FUZZ
@given(one_bad_key())
def test_one_bad_value_under_any_key_costs_that_key_only(case):
    key, raw = case
    view = parse(_snapshot(raw), KEYS)
    # the daemon's pass: decide, then the transaction it would commit
    decision = decide(NOW, view)
    executor.operations(KEYS, decision, view, now=NOW, writer="w")
    for action in decision.actions:  # what it writes, it can read back
        if isinstance(action, SetStatus):
            RunStatus.from_json(action.status.to_json())
        elif isinstance(action, StartRound):
            RoundRecord.from_json(action.record.to_json())
        elif isinstance(action, Emit):
            EventRecord.from_json(EventRecord(time=NOW, kind=action.kind, message=action.message,
                                              fields=action.fields).to_json())
    # the API's replies and the incident traces (telemetry, on the daemon's loop)
    health.run_health(view, now=NOW, served_by="d")
    health.list_nodes(view, now=NOW)
    health.list_checkpoints(view, limit=0)
    tracer = IncidentTracer(trace.NoOpTracer(), metrics.NoOpMeter("fuzz"))
    for kv, ev in view.events:
        health.event_message(kv, ev)
        tracer.feed(ev, live=True, job_id="J")
    # every other key was read as it was (a node's status goes with its registration)
    name = key.rpartition("/")[2]
    affected = {key} | ({KEYS.nodestatus_key(name)} if key == KEYS.node_key(name) else set())
    assert set(view.ignored) <= affected
    assert set(view.nodes) >= {"a", "b", "s"} - {name}
    assert set(view.node_status) >= {"a", "b"} - {name}


HUGE = "x" * 1_000_000  # a value etcd takes (1.5 MiB a request)


@pytest.mark.parametrize("variant, node, change", [
    ("recovered", "a", {"health": {"state": "failed", "gpu": {"state": "failed",
                                                               "reasons": [HUGE] * 6}}}),
    ("spikes", "a", {"health": {"state": "failed", "host": {"state": "failed", "swap": True,
                                                             "reasons": [HUGE]}}}),
    ("hang", "b", {"hang": {**_HANG, "at": NOW - 2, "stacks": HUGE}}),
    ("crash", "b", {"exit_codes": {str(i): 1 for i in range(100_000)}}),
])
def test_a_huge_report_is_not_copied_whole_into_the_leaders_writes(variant, node, change):
    """One transaction is at most 1.5 MiB to etcd: a decision that copied an agent's huge
    value would fail at every pass, and the run would never move on."""
    raw = base(variant)
    status = json.loads(raw[KEYS.nodestatus_key(node)])
    raw[KEYS.nodestatus_key(node)] = json.dumps({**status, **change}).encode()
    view = parse(_snapshot(raw), KEYS)
    assert not view.ignored
    decision = decide(NOW, view)
    written = [a.status.to_json() for a in decision.actions if isinstance(a, SetStatus)] + [
        json.dumps(a.fields).encode() + a.message.encode()
        for a in decision.actions if isinstance(a, Emit)]
    assert written and sum(map(len, written)) < 20_000, decision.reason[:300]

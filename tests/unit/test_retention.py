"""Retention (what leaves etcd, table tests of plan()) and the history files it leaves to."""

from __future__ import annotations

import json

import pytest

from lazarus.core import etcd as E
from lazarus.core.errors import UserError
from lazarus.core.records import (RUNNING, CheckpointRecord, EventRecord, Keys, RoundRecord,
                                  RunStatus)
from lazarus.daemon.history import CHECKPOINTS, EVENTS, History, merged_events
from lazarus.daemon.retention import DAY_S, Retention, plan

K = Keys()
NOW = 1_000 * DAY_S


def kv(key: str, value: bytes, rev: int = 1) -> E.KV:
    return E.KV(key=key, value=value, create_revision=rev, mod_revision=rev, version=1, lease=0)


def event(t: float, n: int = 0) -> E.KV:
    ev = EventRecord(time=t, kind="k", message=f"m{n}")
    return kv(f"{K.events}{int(t * 1e9):020d}-w-{n}", ev.to_json(), rev=n + 1)


def rnd(n: int) -> E.KV:
    rec = RoundRecord(round=n, job_id="J", members=["a"], nproc_per_node=1, world_size=1,
                      dp=1, tp=1, store_host="h", store_port=1)
    return kv(K.round_key(n), rec.to_json())


def ckpt(step: int, *, job="J", good=True, at=NOW) -> E.KV:
    rec = CheckpointRecord(step=step, path=f"/c/{step}", round=1, job_id=job, good=good,
                           committed_at=at)
    return kv(K.checkpoint_key(step), rec.to_json())


def snap(*kvs: E.KV, status: RunStatus | None = None) -> E.Snapshot:
    extra = [kv(K.status, status.to_json())] if status else []
    return E.Snapshot(revision=99, kvs={x.key: x for x in [*kvs, *extra]})


def pruned(todo, kind) -> list[str]:
    return [x.key for x in todo[kind]]


def test_events_past_the_count_or_the_age_go_oldest_first():
    evs = [event(NOW - 10 + i, i) for i in range(10)]
    old = event(NOW - 8 * DAY_S, 99)
    todo = plan(NOW, snap(*evs, old), K, Retention(events=4))
    assert pruned(todo, EVENTS) == [old.key] + [e.key for e in evs[:6]]
    # within both limits: nothing goes
    assert plan(NOW, snap(*evs), K, Retention())[EVENTS] == []


def test_rounds_keep_the_newest_and_always_the_current_one():
    status = RunStatus(job_id="J", state=RUNNING, round=2)   # round 2: an old one, current
    todo = plan(NOW, snap(*(rnd(n) for n in range(1, 8)), status=status), K,
                Retention(rounds=3))
    assert pruned(todo, "rounds") == [K.round_key(n) for n in (1, 3, 4)]


def test_checkpoints_keep_the_restore_point_and_the_newest_good_of_the_job():
    status = RunStatus(job_id="J", state=RUNNING, round=1, restore="/c/2")
    records = [ckpt(1), ckpt(2), ckpt(3), ckpt(4, good=False), ckpt(5, job="other"),
               ckpt(6, job="other"), ckpt(7, at=NOW - 9 * DAY_S, job="other")]
    todo = plan(NOW, snap(*records, status=status), K, Retention(checkpoints=2))
    # newest two by step: 6 and 7; 2 is restored from; 3 is J's newest good; 7 is too old
    assert pruned(todo, CHECKPOINTS) == [K.checkpoint_key(s) for s in (1, 4, 5, 7)]


def test_forged_newer_records_do_not_push_the_verified_one_out(tmp_path):
    """An agent's credentials may write checkpoint records: a flood of forged good ones with
    higher steps must not leave the job's real newest good checkpoint to the count."""
    from lazarus.core import jobspec
    ckdir = tmp_path / "ck"
    real = ckdir / "step-00000003"
    real.mkdir(parents=True)
    (real / "manifest.json").write_text(json.dumps({"job_id": "J", "step": 3}))
    job = jobspec.from_dict({"job": {"name": "t", "nodes": 1, "id": "J"},
                             "train": {"steps": 9, "model": {"name": "tiny"},
                                       "data": {"global_batch": 8},
                                       "checkpoint": {"dir": str(ckdir)}}}, source="test")
    mine = kv(K.checkpoint_key(3), CheckpointRecord(step=3, path=str(real), round=1,
                                                    job_id="J", committed_at=NOW).to_json())
    forged = [ckpt(s) for s in range(10, 20)]  # /c/<step>: outside the job's dir
    status = RunStatus(job_id="J", state=RUNNING, round=1)
    todo = plan(NOW, snap(mine, *forged, kv(K.accepted_job, job.to_json()), status=status), K,
                Retention(checkpoints=2))
    assert mine.key not in pruned(todo, CHECKPOINTS)


def test_keys_not_of_our_making_are_left_alone_and_garbage_goes_by_count():
    foreign = [kv(K.rounds + "notes", b"x"), kv(K.checkpoints + "README", b"x"),
               kv(K.events + "by-hand", b"x")]
    garbage = kv(K.checkpoint_key(1), b"not json")
    todo = plan(NOW, snap(*foreign, garbage, ckpt(2), ckpt(3), kv(K.status, b"{bad")), K,
                Retention(checkpoints=2))
    assert pruned(todo, CHECKPOINTS) == [garbage.key]
    assert todo[EVENTS] == [] and todo["rounds"] == []


@pytest.mark.parametrize("text,problem", [
    ("events=0", "--retention events must be at least 1"),
    ("rounds=many", "--retention rounds: 'many' is not a number"),
    ("weeks=2", "--retention: unknown kind 'weeks'"),
    ("days=-1", "--retention days must be at least 1"),
])
def test_bad_retention_is_one_clear_error(text, problem):
    with pytest.raises(UserError) as e:
        Retention.parse(text)
    assert problem in str(e.value)


def test_retention_parses_a_subset_and_defaults_the_rest():
    assert Retention.parse("events=10, days=2") == Retention(events=10, max_age_s=2 * DAY_S)
    assert Retention.parse("") == Retention()


def test_history_keeps_one_record_per_key_and_survives_a_torn_line(tmp_path):
    h = History.at(tmp_path, K)
    a, b = event(NOW, 1), event(NOW + 1, 2)
    h.append(EVENTS, [a, b])
    h.append(EVENTS, [a])                         # a crash between archive and delete
    assert list(h.read(EVENTS)) == [a.key, b.key]
    with open(h.path(EVENTS), "a") as f:          # a crash in the middle of a line
        f.write('{"key": "' + K.events + 'x", "revi')
    assert list(h.read(EVENTS)) == [a.key, b.key]
    c = event(NOW + 2, 3)
    with open(h.path(EVENTS), "a") as f:           # junk ends at the next newline
        f.write("\n")
    h.append(EVENTS, [c])
    assert [kv.key for kv, _ in merged_events(h, snap(), K)] == [a.key, b.key, c.key]
    line = json.loads(h.path(EVENTS).read_text().splitlines()[0])
    assert line["record"]["message"] == "m1" and line["revision"] == 2   # readable JSON


def test_merged_events_prefer_etcd_and_sort_by_key(tmp_path):
    h = History.at(tmp_path, K)
    a, b = event(NOW, 1), event(NOW + 1, 2)
    h.append(EVENTS, [b])
    newer_b = kv(b.key, b.value, rev=50)
    got = merged_events(h, snap(a, newer_b), K)
    assert [(x.key, x.mod_revision) for x, _ in got] == [(a.key, 2), (b.key, 50)]
    assert merged_events(None, snap(a), K)[0][1].message == "m1"


def test_a_value_that_is_not_json_is_archived_as_text(tmp_path):
    h = History.at(tmp_path, K)
    h.append(CHECKPOINTS, [kv(K.checkpoint_key(1), b"\xffnot json")])
    (back,) = h.read(CHECKPOINTS).values()
    assert back.value.startswith(b"\xef\xbf\xbdnot json")

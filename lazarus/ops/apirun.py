"""`lazarus run` and `lazarus submit` through the daemon's gRPC API, with a submit token: the
job goes in by SubmitJob (as the text of a job file; the daemon validates it again), the run is
followed by WatchEvents from the revision SubmitJob wrote it at, and its outcome read from
GetRunHealth. A user holds only that token; etcd's credentials stay with the daemons and the
agents (docs/security.md).

A followed stream that breaks (its daemon died, the network went away) is opened again, on
whichever daemon of the address list answers, from the revision after the last event printed:
nothing is printed twice, nothing lost. A stream is also opened again every RECHECK_S, and the
run's state asked then, so that an outcome whose event is gone (retention, a daemon that
failed over) still ends the follow.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import grpc
import tomli_w

from lazarus.core.consoletext import printable
from lazarus.core.jobspec import JobSpec
from lazarus.core.records import TERMINAL
from lazarus.ops import client
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from lazarus.proto.lazarus.v1 import lazarus_pb2_grpc as pb_grpc

# How long one followed stream stays open before it is opened again and the run's state asked;
# a quiet run costs one GetRunHealth this often.
RECHECK_S = 30.0
# How long to wait between tries while no daemon answers: the run goes on meanwhile.
RETRY_S = 2.0
# The outcome when the leader turned the job down (its job_rejected event).
REJECTED = "REJECTED"


def job_toml(spec: JobSpec) -> str:
    """The job file of `spec`, for SubmitJob: what jobspec.from_dict reads back as the same job,
    its id included (the id is how its run is followed)."""
    job = {"id": spec.id, "name": spec.name, "nodes": spec.nodes, "min_nodes": spec.min_nodes,
           "nproc_per_node": spec.nproc_per_node, "max_restarts": spec.max_restarts,
           "rendezvous_timeout_s": spec.rendezvous_timeout_s, "command": spec.command,
           "env": spec.env, "start_on_spares": spec.start_on_spares}
    if spec.cwd is not None:
        job["cwd"] = spec.cwd
    if spec.failure_unit != "world":
        job.update(failure_unit=spec.failure_unit, replicas=spec.replicas)
    doc = {"job": job}
    doc.update((table, d) for table, d in (("policy", spec.policy), ("train", spec.train)) if d)
    return tomli_w.dumps(doc)


def submit(target: client.Target, text: str) -> pb.SubmitJobReply:
    """SubmitJob with the text of a job file; client.Failed when the daemon refuses it (a bad
    job: exit code 2, its field named; a run already going: 1; the token: 4)."""
    return client.call(target, "SubmitJob", pb.SubmitJobRequest(job_toml=text))


def event_line(ev: pb.Event) -> str:
    """How `lazarus run` prints an event, as it does one read from etcd."""
    return printable(f"  [{ev.kind}] {ev.message}")


class _Outcome:
    """The run's final state from GetRunHealth. Until the leader accepts the job, the run
    there is the one before it; once ours was seen, a run of another job means ours ended
    and was replaced, its state not known any more."""

    def __init__(self, target: client.Target, job_id: str):
        self.target, self.job_id = target, job_id
        self._seen = False

    def __call__(self) -> str | None:
        """The final state, or None while the run goes on (or is not yet accepted)."""
        health = client.call(self.target, "GetRunHealth", pb.GetRunHealthRequest())
        if health.job_id == self.job_id:
            self._seen = True
            return health.state if health.state in TERMINAL else None
        if self._seen and health.job_id:
            return f"REPLACED by job {health.job_id}"
        return None


def follow(target: client.Target, job_id: str, *, after_revision: int,
           say: Callable[[str], None] = print, recheck_s: float = RECHECK_S) -> str:
    """Print the job's events from `after_revision` on until its run ends; its final state
    (SUCCEEDED, FAILED, CANCELLED, REJECTED or REPLACED ...). Raises client.Failed for a
    refusal (the token), never for a daemon that is away: that is waited out, said once."""
    last = after_revision
    away = False
    outcome = _Outcome(target, job_id)
    while True:
        try:
            state = outcome()
            if state is not None:
                return state
            for ev in _stream(target, last + 1, recheck_s):
                last = max(last, ev.revision)
                say(event_line(ev))
                if ev.kind == "job_rejected" and _field(ev, "id") == job_id:
                    return REJECTED
                if ev.state in TERMINAL and (state := outcome()) is not None:
                    return state
            away = False
        except client.Failed as e:
            if e.code != client.EXIT_UNREACHABLE:
                raise
            if not away:
                say(printable(f"  ! {e}; the run goes on, retrying"))
            away = True
            time.sleep(RETRY_S)


def _field(ev: pb.Event, name: str):
    return ev.fields[name] if name in ev.fields else None


def _stream(target: client.Target, start_revision: int, seconds: float):
    """The events from `start_revision` for up to `seconds`, from the first daemon that
    answers. Ends quietly at the deadline, and when a stream that delivered breaks (the
    caller watches again from its last event, on whichever daemon answers then); raises
    client.Failed when none answers, or one refuses."""
    failures: list[client.Failed] = []
    request = pb.WatchEventsRequest(start_revision=start_revision, follow=True)
    with contextlib.closing(client._channels(target, target.addresses, failures)) as daemons:
        for address, channel in daemons:
            delivered = False
            try:
                for ev in pb_grpc.LazarusStub(channel).WatchEvents(
                        request, timeout=seconds, metadata=client._metadata(target)):
                    delivered = True
                    yield ev
                return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return  # the recheck: the caller asks the run's state, then watches again
                failure = client._failure(e, address, target)
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # too many streams on that daemon, or this one fell behind: watch again
                    failure = client.Failed(str(failure), client.EXIT_UNREACHABLE,
                                            why=f"{address}: {e.details()}")
                if failure.code != client.EXIT_UNREACHABLE:
                    raise failure from None
                if delivered:
                    return  # the next daemon would start over from start_revision
                failures.append(failure)
    raise client._none_answered(failures, target)

"""Ports for an `Agent` built in a test without a node's processes, sockets or devices
(lazarus.agent.ports.Ports): a lease and reads of the real etcd it is given, and nothing
else -- no parked workers, a channel that records what it would send, no store listening."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lazarus.agent.assignment import read as read_assignment
from lazarus.agent.health import NodeHealth
from lazarus.agent.workers import Workers
from lazarus.core import etcd as E


@dataclass
class RecordingChannel:
    path: str = "unused"
    sent: list[dict] = field(default_factory=list)

    def broadcast(self, msg: dict) -> None:
        self.sent.append(msg)

    def send_to(self, pid: int, msg: dict) -> bool:
        self.sent.append({"to": pid, **msg})
        return True

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class NoStore:
    port: int = 1


class BarePorts:
    def __init__(self, scratch: Path, nproc: int = 1):
        self.scratch, self.nproc = scratch, nproc

    def left(self):
        return None

    def save_left(self, left) -> None:
        pass

    def session(self, etcd, *, ttl_s, on_lost, resume):
        return E.Session(etcd, ttl_s=ttl_s, on_lost=on_lost, resume=resume)

    def read_assignment(self, etcd, keys, unreadable, on_request):
        return read_assignment(etcd, keys, unreadable, on_request)

    def health(self) -> NodeHealth:
        return NodeHealth(gpu_backend="sim", gpus=self.nproc, fault_script=None)

    def workers(self, agent_grace_s, script_pg_timeout_s) -> Workers:
        return Workers(nproc=self.nproc, env={}, log_dir=self.scratch / "logs",
                       notes_dir=self.scratch, park=False)

    def channel(self, *, on_message, admit) -> RecordingChannel:
        return RecordingChannel()

    def store(self) -> NoStore:
        return NoStore()

    def host_round_store(self, rec, store) -> None:
        pass

    def tier0(self, *, lookup, on_kept):
        return None

    def preflight(self, *, run, on_done, store):
        return None, None

    def close(self) -> None:
        pass

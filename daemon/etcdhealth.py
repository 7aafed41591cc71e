"""The daemon's watch over etcd itself: outages, alarms, and what the leader may not conclude
while etcd is impaired.

A node's absence from etcd (its lease gone, its status missing) shows its death only while
etcd works. When etcd refuses writes (the NOSPACE alarm), has lost its quorum or cannot be
reached, a live agent may fail to refresh or re-register, and etcd restarts lease timers when
it elects a leader again (docs/constraints.md, "etcd and its clients"). So while etcd is
impaired, and for one lease TTL after, the leader holds every decision that would evict a
node: training goes on as it is, since no worker is stopped unless a round record says so.

The NOSPACE alarm cannot be recorded in etcd while it lasts (etcd refuses the write): the
leader logs it at once and writes an `etcd_alarm` event when the alarm is cleared, saying how
long writes were refused.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from lazarus.core import etcd as E
from lazarus.core import settings
from lazarus.core.records import RECOVERING, EventRecord, Keys
from lazarus.daemon.actions import Decision, SetStatus, StartRound
from lazarus.daemon.leader import Leadership
from lazarus.daemon.view import ClusterView

log = logging.getLogger("lazarus.daemon")

# One Alarm RPC this often (a tiny read): a run at steady state writes nothing from the
# daemon, so a refused write would not tell us.
ALARM_POLL_S = 5.0
# Incidents judged from a node's absence in etcd.
ABSENCE_INCIDENTS = ("node_lost", "rendezvous_timeout")


@dataclass(slots=True)
class AlarmSpell:
    kinds: list[str]
    members: list[str]
    since: float  # wall time
    event_pending: bool = False
    cleared_at: float = 0.0
    fields: dict = field(default_factory=dict)


def evicted(decision: Decision, view: ClusterView) -> list[str]:
    """Nodes the decision would take out of the run."""
    out: set[str] = set()
    members = view.status.members if view.status is not None else []
    for action in decision.actions:
        if isinstance(action, SetStatus) and action.status.state == RECOVERING:
            incident = action.status.incident or {}
            if incident.get("kind") in ABSENCE_INCIDENTS:
                out.update(n for n in str(incident.get("culprit", "")).split(",") if n)
        elif isinstance(action, StartRound):
            kept = set(action.record.members)
            out.update(n for n in members if n not in kept)
    return sorted(out)


def lease_grace_s(view: ClusterView) -> float:
    """How long after etcd is back a node's absence still may be etcd's doing: the longest
    lease TTL of the nodes, plus a second for the agent to register again."""
    return max((n.lease_ttl_s for n in view.nodes.values()), default=settings.LEASE_TTL_S) + 1.0


class EtcdHealth:
    """Feed it every pass's outcome (`ok`/`failed`) and call `poll` once a pass; ask `hold`
    before acting on a decision."""

    def __init__(self, etcd: E.Etcd, keys: Keys, *, writer: str,
                 alarm_poll_s: float = ALARM_POLL_S):
        self.etcd = etcd
        self.keys = keys
        self.writer = writer
        self.alarm_poll_s = alarm_poll_s
        self.outage = E.OutageLog(etcd, log, "training goes on; no node is evicted until "
                                             "etcd is back")
        self.alarm: AlarmSpell | None = None
        self._impaired_at: float | None = None  # monotonic, the last time etcd was impaired
        self._next_poll = 0.0
        self._hold_logged = ""

    # -- what the loop reports ------------------------------------------------------------------
    def ok(self) -> None:
        """A pass went through (reads at least: under NOSPACE only the alarm tells)."""
        if self.outage.since is not None:
            self._impaired_at = time.monotonic()
            self.outage.ok(writes_ok=self.alarm is None or self.alarm.event_pending)

    def failed(self, error: E.EtcdUnavailable) -> None:
        self._impaired_at = time.monotonic()
        self.outage.failed(error)
        if isinstance(error, E.EtcdNoSpace):
            self._next_poll = 0.0  # look at the alarm now

    # -- alarms ---------------------------------------------------------------------------------
    def poll(self, leadership: Leadership) -> None:
        """Look at etcd's alarms at a bounded rate; record a cleared one as an event."""
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + self.alarm_poll_s
            self._update(self.etcd.alarms())
        if self.alarm is not None and self.alarm.event_pending:
            self._emit(leadership)

    def _update(self, alarms: list[E.Alarm]) -> None:
        if alarms:
            self._impaired_at = time.monotonic()
            kinds = sorted({a.kind for a in alarms})
            members = sorted({f"{a.member_id:x}" for a in alarms})
            if self.alarm is None or self.alarm.event_pending:
                self.alarm = AlarmSpell(kinds=kinds, members=members, since=time.time())
                log.warning("etcd raised the %s alarm (member %s): it refuses writes; training "
                            "goes on, no node is evicted, no checkpoint is registered until "
                            "an operator compacts, defragments and disarms it "
                            "(docs/operations.md)", "/".join(kinds), ", ".join(members))
            return
        if self.alarm is not None and not self.alarm.event_pending:
            a = self.alarm
            a.cleared_at = time.time()
            a.event_pending = True
            a.fields = {"alarm": "/".join(a.kinds), "members": a.members, "since": a.since,
                        "cleared_at": a.cleared_at,
                        "duration_s": round(a.cleared_at - a.since, 1)}
            log.info("etcd's %s alarm is cleared after %.0f s", "/".join(a.kinds),
                     a.cleared_at - a.since)

    def _emit(self, leadership: Leadership) -> None:
        a = self.alarm
        assert a is not None
        if not leadership.is_leader:
            self.alarm = None  # the leader writes it
            return
        began = time.strftime("%H:%M:%S", time.localtime(a.since))
        msg = (f"etcd {'/'.join(a.kinds)} alarm from {began} for {a.fields['duration_s']:.0f} s: "
               "etcd refused writes (no evictions, no checkpoint registered meanwhile); "
               "training went on")
        ev = EventRecord(time=a.cleared_at, kind="etcd_alarm", message=msg, fields=a.fields)
        if self.etcd.txn([leadership.fence()],
                         [E.put_op(self.keys.event_key(self.writer), ev.to_json())]):
            self.alarm = None

    # -- what the leader may do -----------------------------------------------------------------
    def impaired(self, grace_s: float) -> bool:
        if self.alarm is not None and not self.alarm.event_pending:
            return True
        return self._impaired_at is not None and time.monotonic() - self._impaired_at < grace_s

    def hold(self, decision: Decision, view: ClusterView) -> str | None:
        """Why the decision must wait, when it evicts nodes while etcd is impaired; logged
        once per reason."""
        nodes = evicted(decision, view)
        if not nodes or not self.impaired(lease_grace_s(view)):
            self._hold_logged = ""
            return None
        why = (f"holding the eviction of {', '.join(nodes)} ({decision.reason}): etcd is "
               "impaired or just recovered, and an agent may not have been able to reach it")
        if why != self._hold_logged:
            self._hold_logged = why
            log.warning("%s", why)
        return why

"""Host alerts in the controller policy (table-driven, like test_decide): a failing checkpoint
dir is alerted once per change and the run goes on; only a node's own memory exhaustion is
swapped out."""

from __future__ import annotations

import dataclasses

from lazarus.daemon.actions import Emit, RequestDrain, SetStatus
from lazarus.daemon.decide import decide
from lazarus.core.records import RUNNING
from tests.unit.test_decide import NOW, kinds, ns, only, status, view

FULL = "checkpoint dir /ckpt is not writable (ENOSPC: No space left on device)"


def host(state, *reasons):
    return {"state": state, "gpu": {"state": "healthy", "gpus": []},
            "host": {"state": state, "reasons": list(reasons)}}


def running(members_health: dict, **kw):
    st = status(RUNNING, **kw)
    statuses = [ns(n, "running", step=5, health=h) for n, h in members_health.items()]
    return st, statuses


def test_shared_storage_full_is_alerted_once_per_node_and_nobody_is_swapped():
    st, statuses = running({"a": host("failed", FULL), "b": host("failed", FULL)})
    d = decide(NOW, view(status=st, spares=("s",), node_status=statuses))
    assert kinds(d.actions) == ["SetStatus", "Emit:host_alert", "Emit:host_alert"]
    alerts = [a for a in d.actions if isinstance(a, Emit)]
    assert [a.fields["node"] for a in alerts] == ["a", "b"]
    assert all("host alert on" in a.message and "No space left on device" in a.message
               and "training goes on" in a.message for a in alerts)
    after = only(d.actions, SetStatus).status
    assert after.state == RUNNING and set(after.host_alerts) == {"a", "b"}
    # The next pass sees the alert recorded: no repeat, and no swap (a spare shares the disk).
    d = decide(NOW + 1, view(status=after, spares=("s",), node_status=statuses))
    assert d.actions == [], d.reason


def test_one_full_disk_is_alerted_but_not_drained():
    # The first agent to see a shared disk fill up is alone for a moment; and a drain waits
    # for a checkpoint that a full disk cannot take. Storage faults are alerts only.
    st, statuses = running({"a": host("failed", FULL), "b": host("healthy")})
    d = decide(NOW, view(status=st, spares=("s",), node_status=statuses))
    assert kinds(d.actions) == ["SetStatus", "Emit:host_alert"]
    after = only(d.actions, SetStatus).status
    assert decide(NOW + 1, view(status=after, spares=("s",), node_status=statuses)).actions == []


def test_a_node_out_of_memory_is_alerted_then_swapped_for_a_spare():
    oom = host("failed", "memory 98% in use (0.3 GiB available)")
    oom["host"]["swap"] = True
    st, statuses = running({"a": oom, "b": host("healthy")})
    d = decide(NOW, view(status=st, spares=("s",), node_status=statuses))
    assert kinds(d.actions) == ["SetStatus", "Emit:host_alert"]
    after = only(d.actions, SetStatus).status
    d = decide(NOW + 1, view(status=after, spares=("s",), node_status=statuses))
    assert only(d.actions, RequestDrain).node == "a"
    assert "swap in s" in d.reason


def test_space_back_clears_the_alert_once():
    st, statuses = running({"a": host("healthy"), "b": host("healthy")},
                           host_alerts={"a": [FULL], "b": [FULL]})
    d = decide(NOW, view(status=st, node_status=statuses))
    assert kinds(d.actions) == ["SetStatus", "Emit:host_alert_cleared", "Emit:host_alert_cleared"]
    after = only(d.actions, SetStatus).status
    assert after.host_alerts == {}
    assert decide(NOW + 1, view(status=after, node_status=statuses)).actions == []


def test_an_alerted_node_that_left_the_run_is_dropped_silently():
    st, statuses = running({"a": host("healthy"), "b": host("healthy")},
                           host_alerts={"gone": [FULL]})
    d = decide(NOW, view(status=st, node_status=statuses))
    assert kinds(d.actions) == ["SetStatus"]
    assert only(d.actions, SetStatus).status == dataclasses.replace(st, host_alerts={})

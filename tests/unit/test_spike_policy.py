"""The daemon's loss-spike policy (table tests of decide()) and its configuration."""

from __future__ import annotations

import pytest

from lazarus.core import jobspec
from lazarus.daemon.actions import MarkCheckpoint, SetStatus, StartRound
from lazarus.daemon.decide import decide
from lazarus.core.errors import UserError
from lazarus.core.records import RUNNING, CheckpointRecord
from tests.unit.test_decide import NOW, job, ns, only, status, view


def spiky(steps, *, first=100):
    return [{"step": s, "window": [first + 8 * s, first + 8 * s + 7], "loss": 9.0,
             "reason": "loss"} for s in steps]


def ck(step, good=True):
    return CheckpointRecord(step=step, path=f"/c/{step}", round=1, job_id="J", good=good)


def with_policy(**policy):
    j = job()
    return jobspec.from_dict({"job": {"name": "t", "nodes": 2, "min_nodes": 1,
                                      "nproc_per_node": 2, "id": "J"},
                              "train": j.train, "policy": policy}, source="test")


def test_one_spike_is_the_trainers_business():
    v = view(status=status(RUNNING), node_status=[ns("a", "running", step=30,
                                                     spikes=spiky([25]))])
    assert decide(NOW, v).actions == []


def test_repeated_spikes_roll_back_to_the_last_good_checkpoint_and_skip_the_window():
    j = with_policy(max_spikes=3, window_steps=20, good_after_steps=5, lr_scale=0.5,
                    lr_scale_steps=10)
    ckpts = [ck(10), ck(18), ck(22)]   # 18 is 2 steps before the first spike: not good
    v = view(status=status(RUNNING), j=j, ckpts=ckpts,
             node_status=[ns("a", "running", step=23, spikes=spiky([20, 21, 22])),
                          ns("b", "running", step=23, spikes=spiky([20, 21, 22]))])
    d = decide(NOW, v)
    rec = only(d.actions, StartRound).record
    assert (rec.restore_step, rec.members) == (10, ["a", "b"])
    assert rec.train["data"]["skip_windows"] == [[260, 283]]
    assert rec.train["optimizer"]["lr_scale"] == 0.5 and rec.train["optimizer"]["lr_scale_steps"] == 10
    assert rec.train["checkpoint"]["good_after_steps"] == 5 and rec.train["parallelism"]["dp"] == 4
    st = only(d.actions, SetStatus).status
    assert st.incident["kind"] == "loss_spike" and st.skip_windows == [[260, 283]]
    assert st.lr_scale_until == 20 and st.restarts == 1
    marked = sorted(a.checkpoint.step for a in d.actions if isinstance(a, MarkCheckpoint))
    assert marked == [18, 22]


def test_skip_windows_stay_in_every_later_round():
    v = view(status=status(RUNNING, skip_windows=[[5, 9]]), nodes=("a",), spares=("s",))
    st = only(decide(NOW, v).actions, SetStatus).status  # b lost
    rec = only(decide(NOW, view(status=st, nodes=("a",), spares=("s",))).actions,
               StartRound).record
    assert rec.train["data"]["skip_windows"] == [[5, 9]]
    assert "lr_scale" not in rec.train.get("optimizer", {})  # no lowered lr was ordered


def test_spikes_of_an_older_round_do_not_count():
    v = view(status=status(RUNNING, round=2),
             node_status=[ns("a", "running", round=1, spikes=spiky([20, 21, 22, 23]))])
    assert decide(NOW, v).actions == []


def test_malformed_spike_reports_are_ignored():
    bad = [{"step": "x"}, "junk", {"step": 3, "window": [9, 1]}, {"step": 4, "window": [1]}]
    v = view(status=status(RUNNING), node_status=[ns("a", "running", spikes=bad)])
    assert decide(NOW, v).actions == []


@pytest.mark.parametrize("policy, expect", [
    ({"window_steps": -1}, "window_steps must be a non-negative integer"),
    ({"window_steps": 0}, "window_steps must be at least 1"),
    ({"max_spikes": 0}, "max_spikes must be at least 1"),
    ({"lr_scale": 2.0}, "lr_scale must be in (0, 1]"),
    ({"lr_scale": 0}, "lr_scale must be in (0, 1]"),
    ({"threshold": 3}, "unknown key(s) in [policy]: ['threshold']"),
    ({"good_after_steps": 1.5}, "good_after_steps must be a non-negative integer"),
])
def test_bad_policy_is_a_clear_error(policy, expect):
    with pytest.raises(UserError) as e:
        with_policy(**policy)
    assert expect in str(e.value)

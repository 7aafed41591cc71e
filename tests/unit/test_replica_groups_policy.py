"""The per-step decisions of replica groups (lazarus.trainer.replicapolicy): who is in a step's
quorum, who heals from whom, and which batch shares each replica computes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lazarus.trainer.replicapolicy import Quorum, Silence, decide, divisor, shares

R = 4
subsets = st.sets(st.integers(0, R - 1))


def _decide(**kw):
    base = dict(step=7, attempt=0, expected={0, 1}, arrived={0, 1}, joiners=set(), gone=set(),
                min_replicas=1)
    return decide(**{**base, **kw})


def test_all_present_is_a_quorum_of_all():
    q = _decide()
    assert (q.members, q.healing, q.source) == ((0, 1), (), 0)


def test_a_slow_replica_is_waited_for():
    assert _decide(arrived={0}) is None


def test_a_gone_replica_is_dropped():
    q = _decide(arrived={1}, gone={0})
    assert (q.members, q.healing, q.source) == ((1,), (), 1)


def test_a_joiner_heals_from_a_member_that_took_part():
    q = _decide(expected={0}, arrived={0}, joiners={1})
    assert (q.members, q.healing, q.source) == ((0, 1), (1,), 0)


def test_an_expected_replica_that_waits_to_join_is_a_new_start_healed_not_waited_for():
    """Its node was lost (nobody marked it left) and its new start beats already: not gone by
    silence, yet its last start is, and the new one heals."""
    q = _decide(arrived={0}, joiners={1})
    assert (q.members, q.healing, q.source) == ((0, 1), (1,), 0)


def test_joiners_alone_are_no_quorum():
    assert _decide(expected={0}, arrived=set(), joiners={1}, gone={0}) is None


def test_too_few_replicas_wait():
    assert _decide(arrived={0}, gone={1}, min_replicas=2) is None


@given(expected=subsets, arrived=subsets, joiners=subsets, gone=subsets,
       min_replicas=st.integers(1, R))
def test_a_quorum_never_drops_a_live_expected_replica(expected, arrived, joiners, gone,
                                                      min_replicas):
    q = decide(step=3, attempt=1, expected=expected, arrived=arrived, joiners=joiners, gone=gone,
               min_replicas=min_replicas)
    if q is None:
        return
    assert expected - gone <= set(q.members)
    assert len(set(q.members) - set(q.healing)) >= min_replicas
    assert q.source in q.members and q.source not in q.healing
    assert set(q.healing) <= joiners and set(q.members) == arrived | set(q.healing)
    assert Quorum.from_json(q.to_json()) == q


@given(members=st.sets(st.integers(0, R - 1), min_size=1),
       policy=st.sampled_from(["drop", "respread"]))
def test_shares(members, policy):
    members = tuple(sorted(members))
    got = shares(members, R, policy)
    assert set(got) == set(members)
    flat = [s for v in got.values() for s in v]
    assert len(flat) == len(set(flat))  # no share computed twice
    for m in members:
        assert got[m][0] == m  # a member always computes its own share
    if policy == "drop":
        assert sorted(flat) == list(members) and divisor(got) == len(members)
    else:
        assert sorted(flat) == list(range(R)) and divisor(got) == R
        assert max(map(len, got.values())) - min(map(len, got.values())) <= 1


def test_bad_batch_policy_and_members():
    with pytest.raises(ValueError, match="batch policy"):
        shares((0,), 2, "double")
    with pytest.raises(ValueError, match="subset"):
        shares((0, 5), 2, "drop")


def test_a_beating_replica_is_never_gone():
    s = Silence(wait_s=3, start_wait_s=60)
    assert not any(s.gone(1, count, now=float(t), since=0.0)
                   for count, t in enumerate(range(1, 100, 2), start=1))


def test_silence_longer_than_wait_is_gone():
    s = Silence(wait_s=3, start_wait_s=60)
    assert not s.gone(1, 5, now=10.0, since=0.0)
    assert not s.gone(1, 5, now=13.0, since=0.0)
    assert s.gone(1, 5, now=13.5, since=0.0)
    assert not s.gone(1, 6, now=14.0, since=0.0)  # it beat again


def test_a_replica_never_seen_gets_the_start_wait():
    s = Silence(wait_s=3, start_wait_s=60)
    assert not s.gone(1, 0, now=50.0, since=0.0)
    assert s.gone(1, 0, now=61.0, since=0.0)


@given(beats=st.lists(st.tuples(st.integers(0, 3), st.floats(0, 10)), max_size=30))
def test_gone_only_after_wait_s_without_a_change(beats):
    # The observer's clock starts at its first look: it cannot know how long a count it had
    # never seen stood before.
    s = Silence(wait_s=3, start_wait_s=60)
    now, count, changed = 0.0, 1, None
    for step, dt in beats:
        now += dt
        if step or changed is None:
            count += step
            changed = now
        assert s.gone(1, count, now=now, since=0.0) == (now - changed > 3)

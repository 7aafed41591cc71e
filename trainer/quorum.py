"""A replica leader's side of the per-step quorum (docs/replicas.md, "The quorum"): who takes
part in a step, decided on the quorum's store by the leaders themselves, in a number of
store requests linear in the replicas R.

A leader that asks for (step, attempt) says it arrived and counts itself in (one `add`):
  - the one whose count completes the last quorum's members decides at once (one `check` of
    all their arrivals, a look at the join keys of the replicas outside, the decision);
  - the first to arrive watches the others: every POLL_S it reads the answer and one counter
    of news (a replica marked left, a restarted one asking in: NEWS, bumped by both); only
    when the news moved since its last look at the members, when the askers and the members
    known gone would make a quorum, or after LOOK_S (the grace, at a retry), does it look at
    the members not yet arrived -- their arrival, a join, their leader's silence -- and
    decide once decide() can;
  - the others block in the store's `wait` for the answer (no polling: the store wakes
    them), looking every wait_s whether the watcher itself has gone silent, in which case
    they watch too.
So a step that every member reaches costs each leader a handful of requests, about 4R in
all (and the watcher two a look while it waits), where every leader polling every replica's
keys cost R(2R + 3) at the least: 5.3 s a step on one store at 256 replicas (docs/scale.md,
"In replica mode").

A step's keys are let go KEEP_STEPS steps later, once its answer is in: each leader deletes
its own arrival, the lowest member of the step's quorum the step's shared keys, and raises
FLOOR to it; a leader that would decide a step at or below the floor has been left behind
(LeftOut). Kept, they grew by R + 3 keys a step in the agent's store for the run's life: a
week of 1 s steps at 2 replicas is 3 million keys. R + 4 deletes a step, after the answer,
off the quorum's path.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from lazarus.trainer.replicapolicy import Quorum, Silence, decide

# How long a retry of a step waits for the members of the failed try before it goes on
# without them (docs/replicas.md).
RETRY_GRACE_S = 0.5
# How long the watcher waits, with no news, before it looks at who is missing: in a healthy
# step the last to arrive answers well before (the members' steps differ by their jitter),
# and a silent member takes wait_s to be called gone anyway.
LOOK_S = 1.0
# How often the watcher reads the answer and the news.
POLL_S = 0.01
# A counter every mark_left and every join bumps after its own key: the watcher's cue.
NEWS = "news"
# How often a restarted replica waiting to be let back in says so.
JOIN_SAID_S = 10.0
# How many steps a step's keys outlive its answer: every member of the quorum KEEP_STEPS
# later asked the steps between, so it has read them.
KEEP_STEPS = 2
# The highest step whose keys are gone.
FLOOR = "floor"


class LeftOut(RuntimeError):
    """This replica is not in the quorum of the step (it came too late, or broke): it must be
    restarted to heal."""

_ABSENT = "\x00absent"


def peek(store: dist.Store, key: str) -> str | None:
    """The key's value, or None at once if there is none (a get would wait for it): a
    compare_set that cannot match never writes."""
    value = store.compare_set(key, _ABSENT, _ABSENT).decode()
    return None if value == _ABSENT else value


def _wait(store: dist.Store, key: str, seconds: float) -> bool:
    """Whether `key` exists within `seconds`, woken by the store as it is written."""
    try:
        store.wait([key], timedelta(seconds=max(seconds, 0.001)))
        return True
    except dist.DistStoreError:
        return False


class QuorumClient:
    """One replica leader's requests to the quorum's store (`store`: its own connection)."""

    def __init__(self, store: dist.Store, *, replica: int, replicas: int, min_replicas: int,
                 wait_s: float, start_wait_s: float, timeout_s: float):
        self.store = store
        self.replica, self.replicas, self.min_replicas = replica, replicas, min_replicas
        self.wait_s, self.start_wait_s, self.timeout_s = wait_s, start_wait_s, timeout_s
        self._silence = Silence(wait_s, start_wait_s)
        # the news counter at this leader's last look at the members (or its first ask: what
        # came before, its first quorum's expected set and the silences answer)
        self._news_seen = -1
        # step -> (the tries this leader asked, the quorum it got): the keys to let go
        self._kept: dict[int, tuple[list[int], Quorum]] = {}

    def gone(self, replicas: set[int], since: float) -> set[int]:
        """Those of `replicas` that their supervisor said were lost (mark_left), or whose
        leader has not beaten for wait_s (or, never seen, not since `since` plus
        start_wait_s): measured on this host's clock alone. Three requests a replica."""
        out = set()
        for r in replicas:
            told = peek(self.store, f"left/{r}/{peek(self.store, f'incarnation/{r}')}")
            if told is not None or self._silence.gone(r, self.store.add(f"hb/{r}", 0),
                                                      time.monotonic(), since):
                out.add(r)
        return out

    def _joiners(self, among: set[int]) -> dict[int, str]:
        # a joiner's nonce names the key it waits on: a late writer of an old quorum's answer
        # can never reach a later start of the same replica
        return {r: nonce for r in sorted(among) if (nonce := peek(self.store, f"join/{r}"))}

    def _propose(self, key: str, q: Quorum, joiners: dict[int, str]) -> Quorum:
        floor = peek(self.store, FLOOR)
        if floor is not None and q.step <= int(floor):
            raise LeftOut(f"replica {self.replica} asked for step {q.step}, whose quorum the "
                          f"others decided and let go (they are past step {floor})")
        # The first proposal stored is the quorum, whoever made it.
        decided = Quorum.from_json(self.store.compare_set(key, "", q.to_json()))
        for r in set(decided.healing) & set(joiners):
            self.store.set(f"healed/{r}/{joiners[r]}", key)
        return decided

    def ask(self, step: int, attempt: int, expected: set[int]) -> Quorum:
        """The quorum of (step, attempt); `expected`: the last quorum's members (all replicas
        at the first step)."""
        tries = self._kept.get(step, ([], None))[0]
        q = self._ask(step, attempt, expected)
        self._kept[step] = (tries + [attempt], q)
        self._forget(before=step - KEEP_STEPS + 1)
        return q

    def _forget(self, *, before: int) -> None:
        """Let go of the keys of the steps before `before` that this leader asked."""
        for step in sorted(s for s in self._kept if s < before):
            tries, q = self._kept.pop(step)
            for attempt in tries:
                self.store.delete_key(f"in/{step}.{attempt}/{self.replica}")
            if q.step == step and self.replica == min(q.members):
                for attempt in range(q.attempt + 1):
                    for shared in ("n", "watcher", "q"):
                        self.store.delete_key(f"{shared}/{step}.{attempt}")
                self.store.set(FLOOR, str(step))

    def _ask(self, step: int, attempt: int, expected: set[int]) -> Quorum:
        tag = f"{step}.{attempt}"
        key = f"q/{tag}"
        self.store.set(f"in/{tag}/{self.replica}", "1")
        order = self.store.add(f"n/{tag}", 1)
        started = time.monotonic()
        if self._news_seen < 0:
            self._news_seen = self.store.add(NEWS, 0)
        everyone = set(range(self.replicas))
        if order == len(expected) and self.store.check([f"in/{tag}/{r}" for r in expected]):
            joiners = self._joiners(everyone - expected)
            q = decide(step=step, attempt=attempt, expected=expected, arrived=set(expected),
                       joiners=set(joiners), gone=set(), min_replicas=self.min_replicas)
            if q is not None:
                return self._propose(key, q, joiners)
        if order == 1:
            self.store.set(f"watcher/{tag}", str(self.replica))
        else:
            while not _wait(self.store, key, self.wait_s):
                # the watcher is a leader like any: gone (or never said who it is), watch too
                watcher = peek(self.store, f"watcher/{tag}")
                if watcher is None or self.gone({int(watcher)}, started):
                    break
            else:
                return Quorum.from_json(self.store.get(key))
        return self._watch(step, attempt, expected, started)

    def _watch(self, step: int, attempt: int, expected: set[int], started: float) -> Quorum:
        tag = f"{step}.{attempt}"
        key = f"q/{tag}"
        arrived, gone = {self.replica}, set()
        everyone = set(range(self.replicas))
        look_after = RETRY_GRACE_S if attempt > 0 else LOOK_S
        while not self.store.check([key]):
            news = self.store.add(NEWS, 0)
            # the members still missing are looked at on news (a replica marked left or asking
            # in), once the askers and the gone would make a quorum, or after look_after
            complete = gone and self.store.add(f"n/{tag}", 0) + len(gone) >= len(expected)
            if (news == self._news_seen and not complete
                    and time.monotonic() - started < look_after):
                time.sleep(POLL_S)
                continue
            self._news_seen = news
            # an arrival stays arrived: each look reads only the members still missing
            arrived |= {r for r in everyone - arrived if self.store.check([f"in/{tag}/{r}"])}
            joiners = self._joiners(everyone - arrived)
            gone = self.gone(expected - arrived, started)
            if attempt > 0 and time.monotonic() - started > RETRY_GRACE_S:
                # A collective of this step failed, and every live member saw it fail and asks
                # again at once: one that has not is the one that broke it (a node lost with
                # its ranks: nobody is left to mark it, and its heartbeat's silence would take
                # wait_s). A live one dropped so heals like any restart.
                gone |= expected - arrived
            q = decide(step=step, attempt=attempt, expected=expected, arrived=arrived,
                       joiners=set(joiners), gone=gone, min_replicas=self.min_replicas)
            if q is not None:
                return self._propose(key, q, joiners)
            if time.monotonic() - started > self.timeout_s + self.start_wait_s:
                raise TimeoutError(f"no quorum for step {step} (try {attempt}): only "
                                   f"{sorted(arrived)} of {sorted(expected)} arrived")
            time.sleep(POLL_S)
        return Quorum.from_json(self.store.get(key))

    def join(self) -> Quorum:
        """A restarted replica's way in: say so, and wait for a quorum that takes it in."""
        nonce = uuid.uuid4().hex
        self.store.set(f"join/{self.replica}", nonce)
        self.store.add(NEWS, 1)
        answer = f"healed/{self.replica}/{nonce}"
        began = time.monotonic()
        while not _wait(self.store, answer, min(JOIN_SAID_S, self.start_wait_s)):
            waited = time.monotonic() - began
            if waited > self.start_wait_s:
                raise TimeoutError(f"replica {self.replica} was not let back in within "
                                   f"{self.start_wait_s:.0f} s")
            # a long wait shows in the rank's log, not as silence (the live replicas take a
            # joiner at their next step's quorum)
            print(f"replica {self.replica}: waiting {waited:.0f} s to be let back in by the "
                  f"live replicas", flush=True)
        self.store.delete_key(f"join/{self.replica}")
        return Quorum.from_json(self.store.get(self.store.get(answer).decode()))

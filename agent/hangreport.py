"""Acting on a hang (lazarus.agent.decide.hang): the report, with the stacks of every local
rank taken before anything is killed, or its withdrawal. The daemon names the culprit across
nodes from the reports and restarts the round.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from lazarus.agent import frozen
from lazarus.agent.decide import ReportHang, WithdrawHang
from lazarus.agent.stacks import (ask_flight_records, capture, collect_flight_recorder,
                                  describe_flight, dumpable, flight_records,
                                  request_flight_recorder_dumps)
from lazarus.agent.workers import Group
from lazarus.core.contract import STACK_CAPTURE_S, HangVerdict

if TYPE_CHECKING:
    from lazarus.agent.service import Agent

log = logging.getLogger("lazarus.agent")


def act(agent: Agent, g: Group, action: ReportHang | WithdrawHang) -> None:
    if isinstance(action, WithdrawHang):
        log.info("hang report of round %d withdrawn: the ranks moved again", action.round)
        agent.report.hang = None
    elif isinstance(action, ReportHang):
        report(agent, g, action.verdict)
    else:
        raise AssertionError(f"unknown action {action!r}")


def report(agent: Agent, g: Group, verdict: HangVerdict) -> None:
    """Take the stacks (and the collectives each rank's process groups were in) of `g`'s
    ranks into WORKDIR/hangs/, name the frozen ones the culprits, and keep the report for
    the node status."""
    pids = g.pids()
    stacks_dir = agent.cfg.stacks_dir
    asked = dumpable(pids, stacks_dir)
    # asked first, read after the stacks: the ranks write both meanwhile
    flying = ask_flight_records(pids, stacks_dir)
    request_flight_recorder_dumps(stacks_dir, sorted(g.ranks.values()))  # NCCL's own
    taken_at = time.monotonic()
    before = frozen.samples(pids)
    deadline = taken_at + STACK_CAPTURE_S
    dump = capture(pids, stacks_dir, timeout_s=STACK_CAPTURE_S)
    # A main thread in D is sampled again a moment later, even when another of its threads
    # answered the dump at once: staying there is what names it stuck in the kernel.
    after = frozen.settled(pids, before, taken_at)
    # Within the stacks' own deadline, never after: the daemon's wait for the other nodes'
    # reports is sized on it, and a stopped rank (the culprit) answers neither.
    flights = flight_records(flying, stacks_dir, timeout_s=max(0.0, deadline - time.monotonic()))
    stuck = frozen.frozen({g.ranks[lr]: p.pid for lr, p in g.procs.items() if lr in g.ranks},
                          before, after, dump, asked)
    # "no progress for S s (allowance A s = what it came from)": kept whatever the ranks' part
    stalled = verdict.reason.partition(": ")[0]
    if stuck:
        verdict = dataclasses.replace(
            verdict, culprits=tuple(sorted(stuck)), frozen=stuck,
            reason=f"{stalled}: " + "; ".join(
                f"rank {r} is frozen ({why})" for r, why in sorted(stuck.items())))
    saved = agent.cfg.workdir / "hangs" / f"round{g.round}-{agent.cfg.node}.txt"
    saved.parent.mkdir(parents=True, exist_ok=True)
    # The file the daemon's hang event names: its first line says how long the ranks had.
    saved.write_text(f"=== hang in round {g.round} on {agent.cfg.node}: {stalled} ===\n" + "".join(
        f"=== rank {g.ranks.get(lr)} pid {p.pid} ===\n"
        f"{_frozen_line(stuck.get(g.ranks.get(lr)), after.get(p.pid), p.pid in dump)}"
        f"{_flight_line(flights.get(p.pid), p.pid in flying)}"
        f"{dump.get(p.pid, _silent(p.pid, after, stuck.get(g.ranks.get(lr))))}\n"
        for lr, p in sorted(g.procs.items())))
    for lr, p in g.procs.items():
        if p.pid in flights:  # torch's own JSON beside it, for its fr_trace tool and people
            saved.with_name(f"{saved.stem}-rank{g.ranks.get(lr)}.flight.json").write_bytes(
                flights[p.pid])
    nccl = {r: path for r, path in collect_flight_recorder(stacks_dir).items()
            if r in g.ranks.values()}
    if nccl:
        with open(saved, "a", encoding="utf-8") as f:
            f.write("=== NCCL's flight recorder dumps (pickles: read them with "
                    "python -m torch.distributed.flight_recorder.fr_trace) ===\n" + "".join(
                        f"rank {r}: {path}\n" for r, path in sorted(nccl.items())))
    agent.report.hang = {**verdict.to_dict(), "stacks": str(saved), "at": time.time()}
    log.warning("hang in round %d: %s; stacks in %s", g.round, verdict.reason, saved)


def _flight_line(record: bytes | None, asked: bool) -> str:
    """The stacks file's line on a rank's collectives (lazarus.agent.stacks.describe_flight)."""
    if record is not None:
        return f"collectives (flight recorder): {describe_flight(record)}\n"
    return "collectives (flight recorder): no answer\n" if asked else ""


def _frozen_line(why: str | None, state: frozen.ProcSample | None, answered: bool) -> str:
    """The stacks file's line on a frozen rank whose stack is there all the same: another
    of its threads answered the dump while the main thread was stuck (lazarus.agent.frozen)."""
    if not why or not answered:
        return ""
    threads = f" (thread states, the main one's first: {state.threads})" if state else ""
    return f"frozen: {why}{threads}\n"


def _silent(pid: int, after: dict, why: str | None) -> str:
    """What the stacks file says of a rank that gave no stack."""
    if why:
        return f"(no stack: the process is frozen -- {why})"
    state = after.get(pid)
    return (f"(no stack: the process did not answer; state {state.state or 'gone'})"
            if state is not None else "(no stack: the process did not answer)")

"""Fault injection: a schedule of named faults, and the acts that inject them into a local
cluster. The same names serve `lazarus up --chaos` and the tests.

    kill-worker@STEP[:NODE]   SIGKILL one training rank (of NODE, else of the last member)
    kill-node@STEP[:NODE]     SIGKILL a node's agent; its workers die with it, its lease lapses
    kill-daemon@STEP          SIGKILL the leading daemon; a standby must take over
    revive-node@STEP[:NODE]   start a killed node's agent again (default: the last one
                              killed); it joins the run at the next checkpoint boundary
    loss-spike@STEP           a poisoned batch at STEP: the trainer guard skips it
    diverge@STEP              a poisoned data window from STEP: spikes repeat, the daemon
                              rolls back to the last good checkpoint and skips the window

A schedule is a comma-separated list, e.g. "kill-worker@10,kill-node@30:n1".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lazarus.errors import UserError

KINDS = ("kill-worker", "kill-node", "kill-daemon", "revive-node", "loss-spike", "diverge")
# Faults the trainer injects itself (through the job's [train] inject list), keyed on the
# data it reads, so that they are reproducible and a rollback's skip really removes them.
TRAINER_KINDS = ("loss-spike", "diverge")
_ITEM = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?::(?P<target>[A-Za-z0-9_.-]+))?$")


@dataclass(slots=True)
class Fault:
    kind: str
    step: int
    target: str | None = None
    fired_at: float | None = None   # wall time it was injected
    fired_step: int | None = None   # last completed step seen when it was injected
    hit: str | None = None          # what it hit (node, rank/pid, daemon pid)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "target": self.hit or self.target,
                "injected_at_step": self.fired_step, "time": self.fired_at}


def parse_schedule(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        m = _ITEM.match(item)
        if m is None:
            raise UserError(f"--chaos item {item!r} is not KIND@STEP[:TARGET] "
                            f"(kinds: {', '.join(KINDS)})")
        if m["kind"] not in KINDS:
            raise UserError(f"--chaos: unknown fault {m['kind']!r} (kinds: {', '.join(KINDS)})")
        if m["kind"] in ("kill-daemon", *TRAINER_KINDS) and m["target"]:
            raise UserError(f"--chaos {item!r}: {m['kind']} takes no target")
        step = int(m["step"])
        if step < 1:
            raise UserError(f"--chaos {item!r}: the step must be at least 1")
        faults.append(Fault(kind=m["kind"], step=step, target=m["target"]))
    return sorted(faults, key=lambda f: f.step)

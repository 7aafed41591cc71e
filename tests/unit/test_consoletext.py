"""lazarus.core.consoletext: a message that tries to clear the screen and forge a line of its
own prints as one inert line, its control characters spelled out."""

from __future__ import annotations

from lazarus.core.consoletext import printable
from lazarus.core.records import EventRecord
from lazarus.ops.run import event_line

FORGERY = "\x1b[2J\x1b[H\r\nforged line"


def _inert(out: str) -> None:
    for ch in ("\x1b", "\r", "\n", "\x9b", "\t", "\x00", "\x7f"):
        assert ch not in out, repr(out)


def test_controls_are_spelled_out_and_nothing_else_changes():
    out = printable(FORGERY)
    _inert(out)
    assert out == "\\x1b[2J\\x1b[H\\x0d\\x0aforged line"
    assert printable("\t\x00\x7f\x9b2J") == "\\x09\\x00\\x7f\\x9b2J"
    assert printable("step 40: loss 3.2 – ok [red]é") == "step 40: loss 3.2 – ok [red]é"


def test_an_event_of_lazarus_run_and_up_is_one_inert_line():
    ev = EventRecord(time=0.0, kind="checkpoint_failed\r", message=f"rank 3: {FORGERY}")
    out = event_line(ev)
    _inert(out)
    assert out == "  [checkpoint_failed\\x0d] rank 3: \\x1b[2J\\x1b[H\\x0d\\x0aforged line"

"""What agents write (node names, health reasons, cordon reasons, event messages: etcd records
any node's credentials can write) reaches the operator's terminal through `lazarus status`,
`nodes`, `events` and the commands' replies. Rich markup in it prints as the text it is, and
its control characters (an OSC that retitles the terminal, a CSI that clears it) print as
\\xNN, never reaching the terminal."""

from __future__ import annotations

import time

import pytest

from lazarus.ops import client
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from tests.unit.cli_home import lazarus_home  # noqa: F401 (fixture)

TITLE = "\x1b]0;pwned\x07"   # OSC 0: sets the terminal's title
CLEAR = "\x1b[2J"            # CSI 2J: clears the screen
C1_CSI = "\x9b2J"            # the same, as the 8-bit C1 CSI some terminals take
NODE = f"[bold red]n1{TITLE}"


def _assert_harmless(out: str) -> None:
    for ch in ("\x1b", "\x07", "\x9b"):
        assert ch not in out, repr(out)
    assert "\\x1b]0;pwned\\x07" in out, repr(out)


def test_nodes_print_agent_written_markup_and_escapes_as_text(capsys):
    node = pb.Node(node=NODE, role="[i]t", state="running", host=f"h{CLEAR}",
                   cordoned=True, cordon_reason=f"disk {CLEAR}[red]gone{C1_CSI}")
    node.health.add(monitor="gpu", state="bad", reasons=[f"[u]ecc{CLEAR}"])
    client.render_nodes([node])
    out = capsys.readouterr().out
    _assert_harmless(out)
    row = out.splitlines()[1]
    assert row.startswith(f"[bold red]n1\\x1b]0;pwned\\x07  [i]t "), row
    assert "gpu bad: [u]ecc\\x1b[2J" in row and row.endswith("h\\x1b[2J"), row
    assert "cordoned: disk \\x1b[2J[red]gone\\x9b2J" in out


def test_status_prints_agent_written_markup_and_escapes_as_text(capsys):
    h = pb.RunHealth(job_id="J1", job_name="[bold]demo", state="RUNNING", since=time.time(),
                     reason=f"node {NODE} lost", members=[NODE], served_by="d1")
    h.incident.CopyFrom(pb.Incident(kind="node_lost", culprit=NODE, round=3,
                                    fault_at=time.time(), reason=f"gone{CLEAR}"))
    h.last_checkpoint.CopyFrom(pb.Checkpoint(step=4, path=f"/ck/[red]4{TITLE}", good=True))
    client.render_status(h, time.time())
    out = capsys.readouterr().out
    _assert_harmless(out)
    assert "[bold]demo" in out and "members [bold red]n1" in out and "/ck/[red]4" in out


def test_events_print_escapes_as_text(capsys, monkeypatch):
    events = [pb.Event(kind=f"node_lost{CLEAR}", message=f"{NODE} [bold]lost{C1_CSI}",
                       time=time.time())]
    monkeypatch.setattr(client, "stream_events", lambda target, req: iter(events))
    assert client.events_main(["--address", "127.0.0.1:1"]) == 0
    out = capsys.readouterr().out
    _assert_harmless(out)
    assert "[bold red]n1" in out and "\\x1b[2J" in out and "\\x9b2J" in out


def test_a_commands_reply_and_a_refusal_print_escapes_as_text(capsys, monkeypatch):
    monkeypatch.setattr(client, "call", lambda target, method, request: pb.CommandReply(
        message=f"draining {NODE}"))
    assert client.drain_main([NODE, "--address", "127.0.0.1:1"]) == 0
    _assert_harmless(capsys.readouterr().out)

    def refuse(target, method, request):
        raise client.Failed(f"no node {NODE}", client.EXIT_REFUSED)
    monkeypatch.setattr(client, "call", refuse)
    assert client.drain_main([NODE, "--address", "127.0.0.1:1"]) == client.EXIT_REFUSED
    _assert_harmless(capsys.readouterr().err)


def test_json_output_keeps_the_exact_value_escaped_by_json(capsys, monkeypatch):
    events = [pb.Event(kind="k", message=TITLE)]
    monkeypatch.setattr(client, "stream_events", lambda target, req: iter(events))
    assert client.events_main(["--address", "127.0.0.1:1", "--json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\u001b]0;pwned\\u0007" in out


def test_an_event_message_cannot_start_a_line_of_its_own(capsys, monkeypatch):
    events = [pb.Event(kind="checkpoint_failed", message=f"rank 3{CLEAR}\r\nforged line",
                       time=time.time())]
    monkeypatch.setattr(client, "stream_events", lambda target, req: iter(events))
    assert client.events_main(["--address", "127.0.0.1:1"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert "\r" not in line and line.endswith("rank 3\\x1b[2J\\x0d\\x0aforged line"), line

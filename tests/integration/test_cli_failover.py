"""The operator CLI with several daemon addresses, against real API servers on a real etcd: a
dead address (nothing listens) or a silent one (listens, never answers) gives way to the next,
`lazarus status` names the daemon that answered, and a command goes to the leader first."""

from __future__ import annotations

import socket
import time

import pytest

from lazarus.core.embedded_etcd import free_port
from lazarus.daemon import api
from lazarus.ops import client
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from tests.integration.test_api import TOKEN, _populate
from tests.unit.cli_home import lazarus_home  # noqa: F401 (fixture)


def _serve(etcd, keys, served_by: str):
    srv, port = api.serve(etcd, keys, address="127.0.0.1:0", token=TOKEN, served_by=served_by)
    return srv, f"127.0.0.1:{port}"


@pytest.fixture
def standby(etcd, keys):
    srv, address = _serve(etcd, keys, "standby-1")
    yield address
    srv.stop(grace=0).wait()


@pytest.fixture
def leader(etcd, keys):
    srv, address = _serve(etcd, keys, "leader-0")  # _populate's leader record names leader-0
    yield address
    srv.stop(grace=0).wait()


@pytest.fixture
def silent():
    """An address that accepts TCP connections (the kernel's backlog) and never speaks HTTP/2:
    what a hung daemon or a half-dead host looks like to a client."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_status_fails_over_from_a_dead_address_and_names_the_daemon_that_answered(
        etcd, keys, standby, capsys):
    _populate(etcd, keys, t0=time.time())
    dead = f"127.0.0.1:{free_port()}"
    assert client.status_main(["--address", f"{dead},{standby}", "--token", TOKEN]) == 0
    out = capsys.readouterr().out
    assert "api (J1)  RUNNING" in out
    assert f"answered    {standby} (standby standby-1)" in out, out
    # a command too, with the list from the environment
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAZARUS_ADDRESS", f"{dead}, {standby}")
        assert client.cordon_main(["n2", "--token", TOKEN]) == 0
    assert capsys.readouterr().out.strip() == "cordoned n2: it takes no new work"


def test_no_daemon_answering_names_each_address_in_one_line(capsys):
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    assert client.status_main(["--address", ",".join(dead), "--token", TOKEN]) == \
        client.EXIT_UNREACHABLE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert "no daemon answered" in err and all(a in err for a in dead) and "--address" in err


def test_a_silent_daemon_costs_the_connect_deadline_not_the_call_timeout(
        etcd, keys, standby, silent, capsys):
    _populate(etcd, keys, t0=time.time())
    start = time.monotonic()
    rc = client.status_main(["--address", f"{silent},{standby}", "--token", TOKEN,
                             "--timeout", "60"])
    # without the connect deadline the silent one would hold the CLI for the whole --timeout
    assert rc == 0 and time.monotonic() - start < 30
    assert f"{standby} (standby standby-1)" in capsys.readouterr().out


def test_a_command_goes_to_the_leader_first_and_a_read_to_the_first_that_answers(
        etcd, keys, standby, leader):
    _populate(etcd, keys, t0=time.time())
    dead = f"127.0.0.1:{free_port()}"
    target = client.Target(addresses=[dead, standby, leader], token=TOKEN, source="--address")
    assert client._leader_first(target) == [leader, standby]
    address, reply = client.call_at(target, "CordonNode", pb.CordonNodeRequest(node="n2"))
    assert address == leader and reply.message.startswith("cordoned n2")
    address, health = client.call_at(target, "GetRunHealth", pb.GetRunHealthRequest())
    assert address == standby and not health.served_by_leader
    # no leader among those that answer: the first that answered takes the command
    target.addresses = [dead, standby]
    assert client.call_at(target, "UncordonNode",
                          pb.UncordonNodeRequest(node="n2"))[0] == standby

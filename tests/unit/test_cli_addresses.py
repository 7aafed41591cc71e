"""The daemon addresses the operator CLI takes (--address, $LAZARUS_ADDRESS, the endpoint
file): one or several HOST:PORT, checked where they are read, a bad one refused in one line
naming where it came from; and the status line that names the daemon that answered."""

from __future__ import annotations

import argparse
import time

import pytest

from lazarus.cli import main as cli_main
from lazarus.core import endpoint_file, settings
from lazarus.core.errors import UserError
from lazarus.ops import client
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from tests.unit.cli_home import lazarus_home  # noqa: F401 (fixture)


@pytest.mark.parametrize("text, addresses", [
    ("10.0.0.5:7070", ["10.0.0.5:7070"]),
    ("d1.example:7070,d2.example:7070,d3.example:7070",
     ["d1.example:7070", "d2.example:7070", "d3.example:7070"]),
    (" d1:7070 , d2:7071 ", ["d1:7070", "d2:7071"]),
    # a Kubernetes Service is one name: it spreads the connections itself
    ("lazarus-api.lazarus.svc.cluster.local:7070", ["lazarus-api.lazarus.svc.cluster.local:7070"]),
    ("[::1]:7070,[fd00::5]:7070", ["[::1]:7070", "[fd00::5]:7070"]),
    ("localhost:65535", ["localhost:65535"]),
])
def test_good_lists_keep_their_order(text, addresses):
    assert settings.api_addresses(text, "--address") == addresses


@pytest.mark.parametrize("text, says", [
    ("d1:7070,,d2:7070", "has an empty entry"),
    ("d1:7070,", "has an empty entry"),
    (",", "has an empty entry"),
    ("d1", "'d1' is not HOST:PORT"),
    (":7070", "':7070' is not HOST:PORT"),
    ("d1:0", "has port '0', not a number from 1 to 65535"),
    ("d1:65536", "has port '65536'"),
    ("d1:http", "has port 'http'"),
    ("d1:", "has port ''"),
    ("https://d1:7070", "takes no scheme (TLS is --tls or --tls-ca)"),
    ("::1:7070", "IPv6 goes in brackets"),
    ("d 1:7070", "has host 'd 1'"),
])
def test_bad_lists_are_one_line_naming_the_entry(text, says):
    with pytest.raises(UserError) as e:
        settings.api_addresses(text, "--address")
    message = str(e.value)
    assert message.startswith("--address") and says in message and "\n" not in message
    assert "give HOST:PORT, or several as HOST:PORT,HOST:PORT" in message


def test_the_cli_refuses_a_bad_address_in_one_line_naming_its_source(capsys, monkeypatch):
    assert cli_main(["status", "--address", "d1:7070,,d2:7070"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--address 'd1:7070,,d2:7070'" in err
    monkeypatch.setenv("LAZARUS_ADDRESS", "d1:7070,d2:99999")
    assert cli_main(["drain", "n1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "$LAZARUS_ADDRESS: 'd2:99999' has port" in err


def test_an_endpoint_file_with_a_bad_address_is_named(capsys):
    path = endpoint_file.default_path()
    endpoint_file.write(path, endpoint_file.Endpoint(addresses=["127.0.0.1:7070", "nope"],
                                                     token="t"))
    assert cli_main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"endpoint file {str(path)!r}: 'nope'" in err


def test_the_list_from_the_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("LAZARUS_ADDRESS", "env:1")
    args = _args(["--address", "a:1,b:2"])
    target = client.target(args)
    assert target.addresses == ["a:1", "b:2"] and target.source == "--address"
    target = client.target(_args([]))
    assert target.addresses == ["env:1"] and target.source == "$LAZARUS_ADDRESS"


def test_the_endpoint_files_addresses_are_tried_in_its_order():
    endpoint_file.write(endpoint_file.default_path(), endpoint_file.Endpoint(
        addresses=["d1:7070", "d2:7070"], token="t"))
    assert client.target(_args([])).addresses == ["d1:7070", "d2:7070"]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    client._common(p)
    return p.parse_args(argv)


def test_status_names_the_daemon_that_answered_and_its_role(capsys):
    h = pb.RunHealth(goodput=-1, served_by="d2", served_by_leader=False)
    h.leader.CopyFrom(pb.Leader(id="d1", api="10.0.0.1:7070"))
    client.render_status(h, time.time(), "10.0.0.2:7070")
    out = capsys.readouterr().out
    assert "leader      d1 at 10.0.0.1:7070" in out
    assert "answered    10.0.0.2:7070 (standby d2)" in out
    client.render_status(pb.RunHealth(goodput=-1, served_by="d1", served_by_leader=True),
                         time.time(), "lazarus-api.lazarus.svc:7070")
    assert "answered    lazarus-api.lazarus.svc:7070 (leader d1)" in capsys.readouterr().out

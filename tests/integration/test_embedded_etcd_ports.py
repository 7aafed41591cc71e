"""A port free_port() handed out can be taken by another process before etcd binds it (a
busy machine's tests start many servers): a first start then chooses again instead of
failing the whole cluster."""

from __future__ import annotations

import socket

from lazarus.core import embedded_etcd
from lazarus.core import etcd as E


def test_a_port_taken_before_etcd_binds_it_is_chosen_again(tmp_path, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = embedded_etcd.free_port
    handed = iter([taken])
    monkeypatch.setattr(embedded_etcd, "free_port", lambda: next(handed, None) or real())
    try:
        with embedded_etcd.EmbeddedEtcd(tmp_path / "etcd") as server:
            assert server.client_port != taken
            assert "address already in use" in server.log_file.read_text()  # it did collide
            client = E.Etcd(server.endpoint, auth=server.auth(None))
            try:
                client.put("/k", b"v")
                assert client.get("/k").value == b"v"
            finally:
                client.close()
    finally:
        squatter.close()

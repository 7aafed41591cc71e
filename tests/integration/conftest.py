"""A real etcd server per test module, and a key root of its own per test."""

from __future__ import annotations

import pytest

from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import EmbeddedEtcd
from lazarus.core.records import Keys


@pytest.fixture(scope="module")
def etcd():
    with EmbeddedEtcd() as server:
        client = E.Etcd(server.endpoint)
        yield client
        client.close()


@pytest.fixture
def keys(request):
    return Keys(f"/test/{request.module.__name__}/{request.node.name}/")

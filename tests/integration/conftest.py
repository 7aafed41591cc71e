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


@pytest.fixture(scope="module")
def elastic_logs_in_tmp(tmp_path_factory):
    """For modules that run torchrun: it keeps its workers' logs in a fresh torchelastic_* dir
    under TMPDIR that it never removes; put those with the tests' own files, which pytest
    removes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("torchelastic")))
        yield

"""The committed stubs are what proto/lazarus/v1/*.proto generates today."""

from __future__ import annotations

import pytest

from lazarus.proto import generate

pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) generates the stubs")


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    written = generate.generate(tmp_path)
    assert written, "no .proto sources found"
    stale = [p.name for p in written
             if not (generate.PROTO_DIR / "lazarus" / "v1" / p.name).exists()
             or (generate.PROTO_DIR / "lazarus" / "v1" / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"stale stubs {stale}: run `python -m lazarus.proto.generate`"


def test_stubs_import_under_the_package_name_and_name_the_service():
    from lazarus.proto.lazarus.v1 import lazarus_pb2, lazarus_pb2_grpc

    assert lazarus_pb2.DESCRIPTOR.name == "lazarus/proto/lazarus/v1/lazarus.proto"
    methods = {m.name for m in lazarus_pb2.DESCRIPTOR.services_by_name["Lazarus"].methods}
    assert {"GetRunHealth", "ListNodes", "WatchEvents", "ListCheckpoints", "TriggerCheckpoint",
            "DrainNode", "CordonNode", "UncordonNode", "PauseRun", "ResumeRun", "SubmitJob",
            "CancelJob"} <= methods
    assert hasattr(lazarus_pb2_grpc, "LazarusStub")

"""Regenerate the Python stubs of proto/lazarus/v1/*.proto: `python -m lazarus.proto.generate`.

The include path maps the folder proto/ onto `lazarus/proto`, so the descriptors are named
`lazarus/proto/lazarus/v1/...` (no clash in protobuf's pool with etcd clients' root-level
protos) and the stubs import each other as `lazarus.proto.lazarus.v1`. Needs grpcio-tools
(the dev extra). The stubs are committed; tests/unit/test_proto_stubs_current.py fails when
they are stale.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SOURCES = sorted((PROTO_DIR / "lazarus" / "v1").glob("*.proto"))
OUTPUTS = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs of every source into out_dir (flat); returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-Ilazarus/proto={PROTO_DIR}", f"-I{well_known}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *(f"lazarus/proto/{src.relative_to(PROTO_DIR)}" for src in SOURCES)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in SOURCES:
            produced = Path(tmp) / "lazarus" / "proto" / src.parent.relative_to(PROTO_DIR)
            for suffix in OUTPUTS:
                name = src.stem + suffix
                shutil.copyfile(produced / name, out_dir / name)
                written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lazarus.proto.generate", description=__doc__)
    p.parse_args(argv)
    for path in generate(PROTO_DIR / "lazarus" / "v1"):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Fill tests/gpu/wheels (git-ignored) with what the GPU machine lacks, for its CPython 3.12 on
# x86-64: the wheels of wheels.txt (Lazarus's side), of titan-wheels.txt in wheels/titan (the
# user's TorchTitan venv), and etcd's binary in wheels/bin (`lazarus up` embeds etcd). Needs a
# package index, which that machine has not, and etcd on PATH (deploy/setup-local.sh).
set -euo pipefail
cd "$(dirname "$0")"
fetch() {  # LIST DIR
    mkdir -p "$2"
    grep -v '^#' "$1" | grep -v '^$' | while read -r w; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$2" "$w"
    done
}
fetch wheels.txt wheels
fetch titan-wheels.txt wheels/titan
mkdir -p wheels/bin
etcd=$(command -v etcd) || { echo "fetch-wheels.sh: no etcd on PATH (bash deploy/setup-local.sh)" >&2; exit 2; }
cp "$etcd" wheels/bin/etcd
ls -R wheels

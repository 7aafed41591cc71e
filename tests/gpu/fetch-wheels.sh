#!/usr/bin/env bash
# Fill tests/gpu/wheels (git-ignored) with the wheels of tests/gpu/wheels.txt for the GPU
# machine's CPython 3.12 on x86-64; needs a package index, which that machine has not.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
grep -v '^#' wheels.txt | grep -v '^$' | while read -r w; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d wheels "$w"
done
ls wheels

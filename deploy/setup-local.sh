#!/usr/bin/env bash
# Sets up this checkout on a fresh Debian/Ubuntu machine: the etcd server (Debian package
# etcd-server, for the embedded and local-cluster modes) and a virtualenv in .venv with
# Lazarus installed editable, test tools included. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v etcd >/dev/null 2>&1; then
    echo "installing etcd-server (apt)..."
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null
fi
# Debian's package starts a system etcd on 2379; Lazarus starts its own on free ports.
if ! command -v chromium >/dev/null 2>&1; then
    # headless browser for `lazarus report --png` and the report's rendering test
    echo "installing chromium (apt)..."
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in pyproject.toml to the CPU build available here; on a GPU cluster install
# the CUDA wheel of the same version first.
.venv/bin/python -m pip install -q -e '.[dev]'
echo "ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'), $(etcd --version | head -1)"

#!/usr/bin/env bash
# Sets up this checkout on a fresh Debian/Ubuntu machine: the etcd server (Debian package
# etcd-server, for the embedded and local-cluster modes) and a virtualenv in .venv with
# Lazarus installed editable, test tools included. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
APT_UPDATED=""
# apt_install COMMAND PACKAGE WHY: install PACKAGE unless COMMAND is on PATH already.
apt_install() {
    command -v "$1" >/dev/null 2>&1 && return 0
    echo "installing $2 (apt): $3..."
    if [ -z "$APT_UPDATED" ]; then $SUDO apt-get update -qq; APT_UPDATED=1; fi
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
}
# Debian's package starts a system etcd on 2379; Lazarus starts its own on free ports.
apt_install etcd etcd-server "the embedded and local-cluster modes"
apt_install chromium chromium "\`lazarus report --png\` and the report's rendering test"
apt_install systemd-analyze systemd "\`systemd-analyze verify\` of deploy/systemd/ (tests/deploy)"
apt_install setfacl acl "deploy/job-user.sh: ranks of a user of their own (--run-as) reach the interpreter"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in pyproject.toml to the CPU build available here; on a GPU cluster install
# the CUDA wheel of the same version first.
.venv/bin/python -m pip install -q -e '.[dev]'
echo "ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'), $(etcd --version | head -1)"

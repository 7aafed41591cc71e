#!/usr/bin/env bash
# Makes USER (default lazarus-job) the user a node's ranks run as (`lazarus agent --run-as
# USER`, `lazarus up --run-as USER`; docs/security.md): a system user with a home of its own
# (torch's and Triton's caches, the built-in corpus) and no login, that may pass through --
# not list -- the directories above this checkout's virtualenv and its interpreter (an ACL
# for that user alone: a venv under /root stays closed to everyone else). Safe to run again.
# Run as root, after deploy/setup-local.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
user="${1:-lazarus-job}"
[ "$(id -u)" -eq 0 ] || { echo "job-user.sh: run as root (it adds a user)" >&2; exit 2; }
if ! id -u "$user" >/dev/null 2>&1; then
    useradd --system --create-home --shell /usr/sbin/nologin "$user"
    echo "added user $user (uid $(id -u "$user"))"
fi
python="$(readlink -f .venv/bin/python)"
for target in "$PWD/.venv/bin/python" "$python"; do
    # from / down: a directory is tried only once the ones above it are passable
    d="$(dirname "$target")"
    dirs=()
    while [ "$d" != "/" ]; do dirs=("$d" "${dirs[@]}"); d="$(dirname "$d")"; done
    for d in "${dirs[@]}"; do
        if ! runuser -u "$user" -- test -x "$d"; then
            setfacl -m "u:$user:x" "$d"
            echo "$user may pass through $d"
        fi
    done
done
if ! err="$(runuser -u "$user" -- .venv/bin/python -c 'import lazarus.cli, torch' 2>&1)"; then
    echo "job-user.sh: $user still cannot run this checkout's Python: ${err: -300}" >&2
    exit 1
fi
echo "ready: ranks may run as $user (uid $(id -u "$user"))"

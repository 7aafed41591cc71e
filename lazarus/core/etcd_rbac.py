"""Lazarus's users and roles in etcd, and turning etcd's authentication on.

Roles, under the key root (default /lazarus/v1/):
- `lazarus-daemon`: reads and writes everything under the root (the leader's fenced writes,
  compaction, retention). The API's users and `lazarus submit` act through it too.
- `lazarus-agent`: reads everything under the root; writes only what an agent writes: its
  node record (nodes/), its status (nodestatus/), claims of the checkpoints its ranks
  committed (ckptclaims/, fenced on the round; the leader checks each before it makes it a
  record under checkpoints/) and the events it reports (events/). It cannot write the job,
  the run's state, rounds, checkpoint records, commands, cordons or the leader key: an agent
  host that is taken over can lie about itself, not steer the cluster.
- `root` (etcd's own): users, roles, defragmentation; an operator's, no process of ours.

Set up through etcd's gRPC Auth API (no etcdctl needed): `apply` is idempotent, so running
it again changes passwords, re-grants rights and revokes what our roles may no longer do under
the root (an upgrade takes agents' write on checkpoints/ away by running it again), and works
whether authentication is on (authenticate as root) or not yet.
"""

from __future__ import annotations

import logging

from aetcd import rpc
from aetcd.utils import prefix_range_end

from lazarus.core import etcd as E

log = logging.getLogger(__name__)

ROOT_USER = "root"
DAEMON_USER = "lazarus-daemon"
AGENT_USER = "lazarus-agent"
AGENT_WRITES = ("nodes/", "nodestatus/", "ckptclaims/", "events/")

_READ, _READWRITE = rpc.Permission.READ, rpc.Permission.READWRITE


def permissions(root: str) -> dict[str, list[tuple[int, str]]]:
    """role -> [(permission, key prefix)]."""
    return {DAEMON_USER: [(_READWRITE, root)],
            AGENT_USER: [(_READ, root), *((_READWRITE, root + p) for p in AGENT_WRITES)]}


def _ignore_exists(etcd: E.Etcd, method: str, request) -> bool:
    """True when the call did it, False when it was done already."""
    try:
        etcd.auth_call(method, request)
        return True
    except E.EtcdRefused as e:
        if "already exists" in str(e):
            return False
        raise


def _revoke_others(etcd: E.Etcd, role: str, root: str, prefixes: list[str]) -> None:
    """Revoke what `role` may do under `root` beyond `prefixes`: rights an older version
    granted (agents' write on checkpoints/). Other roots' rights, which clusters sharing this
    etcd hold, stay."""
    wanted = {(p.encode(), prefix_range_end(p.encode())) for p in prefixes}
    held = etcd.auth_call("RoleGet", rpc.AuthRoleGetRequest(role=role)).perm
    for perm in held:
        if perm.key.startswith(root.encode()) and (perm.key, perm.range_end) not in wanted:
            etcd.auth_call("RoleRevokePermission", rpc.AuthRoleRevokePermissionRequest(
                role=role, key=perm.key, range_end=perm.range_end))
            log.info("etcd role %s: revoked its rights on %s", role,
                     perm.key.decode(errors="replace"))


def apply(etcd: E.Etcd, root: str, passwords: dict[str, str]) -> None:
    """Create (or update) the users of `passwords` -- `root` among them -- with their roles
    (a user named like a role gets that role), then turn authentication on. `etcd` is a
    client without a user while authentication is off, else one authenticated as root."""
    if ROOT_USER not in passwords:
        raise ValueError("enabling etcd authentication needs the root user's password")
    for role, perms in permissions(root).items():
        _ignore_exists(etcd, "RoleAdd", rpc.AuthRoleAddRequest(name=role))
        for perm, prefix in perms:
            key = prefix.encode()
            etcd.auth_call("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(
                name=role, perm=rpc.Permission(permType=perm, key=key,
                                               range_end=prefix_range_end(key))))
        _revoke_others(etcd, role, root, [prefix for _, prefix in perms])
    _ignore_exists(etcd, "RoleAdd", rpc.AuthRoleAddRequest(name=ROOT_USER))
    for user, password in passwords.items():
        added = _ignore_exists(etcd, "UserAdd", rpc.AuthUserAddRequest(name=user,
                                                                       password=password))
        # Not root's: etcd ends the sessions of a user whose password changes, this one's
        # included (`etcdctl user passwd root` changes it).
        if not added and user != ROOT_USER:
            etcd.auth_call("UserChangePassword", rpc.AuthUserChangePasswordRequest(
                name=user, password=password))
        role = user if user in (ROOT_USER, *permissions(root)) else None
        if role is not None:
            etcd.auth_call("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=user, role=role))
    etcd.auth_call("AuthEnable", rpc.AuthEnableRequest())
    log.info("etcd authentication on: users %s", ", ".join(sorted(passwords)))

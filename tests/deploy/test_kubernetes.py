"""The Kubernetes manifests validate against the Kubernetes API schemas, strictly (no unknown
field), with the command docs/operations.md ("Deploying") shows. kubernetes-validate carries its
schemas: no cluster and no network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lazarus.core.jobuser import CAPABILITIES, JobUser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
VALIDATE = str(Path(sys.executable).parent / "kubernetes-validate")


def _validate(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([VALIDATE, "--strict", *map(str, files)], capture_output=True,
                          text=True, timeout=120)


def test_every_manifest_validates_strictly():
    files = sorted(DEPLOY.glob("*.yaml"))
    proc = _validate(*files)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = [line for line in proc.stdout.splitlines() if " passed for resource " in line]
    # Every object of every file was checked (a file that parsed to nothing would pass too).
    objects = sum(1 for f in files for doc in f.read_text().split("\n---\n")
                  if "\nkind: " in "\n" + doc)
    assert len(passed) == objects, proc.stdout


def test_a_misspelt_field_fails(tmp_path):
    """--strict is worth something: an unknown field is an error, not a silent no-op."""
    text = (DEPLOY / "lazarus.yaml").read_text()
    bad = tmp_path / "lazarus.yaml"
    bad.write_text(text.replace("dnsPolicy:", "dnsPolcy:"))
    proc = _validate(bad)
    assert proc.returncode != 0 and "dnsPolcy" in proc.stdout + proc.stderr


def _containers(path: Path) -> dict[str, dict]:
    import yaml

    out = {}
    for doc in yaml.safe_load_all(path.read_text()):
        spec = (doc or {}).get("spec", {})
        for c in spec.get("template", {}).get("spec", {}).get("containers", []):
            out[c["name"]] = c
    return out


def test_etcd_is_tls_only_and_every_client_signs_in_with_its_own_user():
    etcd = _containers(DEPLOY / "etcd.yaml")
    args = etcd["etcd"]["args"]
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args
    urls = [a.split("=", 1)[1] for a in args if a.startswith(("--listen-client-urls",
                                                              "--listen-peer-urls"))]
    assert urls and all(u.startswith("https://") for u in urls), urls
    lazarus = _containers(DEPLOY / "lazarus.yaml")
    users = {}
    for name, c in {**lazarus, "enable-auth": etcd["enable-auth"]}.items():
        text = " ".join(c.get("args", []))
        assert "--etcd https://" in text, name
        assert "--insecure" not in text, name
        env = {e["name"]: e for e in c.get("env", [])}
        users[name] = env.get("LAZARUS_ETCD_USER", {}).get("value")
        if users[name]:  # its password from the Secret, never in the manifest
            ref = env["LAZARUS_ETCD_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "etcd-users", "key": f"{users[name]}.password"}
    assert users == {"daemon": "lazarus-daemon", "agent": "lazarus-agent", "enable-auth": None}
    assert "--tls-cert" in lazarus["daemon"]["args"]  # the API on 0.0.0.0 is TLS


def test_agents_seal_their_tier0_copies_with_a_key_from_a_secret():
    lazarus = _containers(DEPLOY / "lazarus.yaml")
    args = " ".join(lazarus["agent"]["args"])
    assert "--replica-key-file /etc/lazarus/replica/key" in args
    mounts = {m["name"]: m for m in lazarus["agent"]["volumeMounts"]}
    assert mounts["replica-key"]["mountPath"] == "/etc/lazarus/replica"
    import yaml

    docs = [d for d in yaml.safe_load_all((DEPLOY / "lazarus.yaml").read_text()) if d]
    volumes = {v["name"]: v for d in docs if d["kind"] == "DaemonSet"
               for v in d["spec"]["template"]["spec"]["volumes"]}
    assert volumes["replica-key"]["secret"]["secretName"] == "lazarus-replica-key"


def test_no_job_code_runs_as_root_or_as_the_agent():
    """Issue 23: the agent ran as root, so did every job's code. The daemon runs as a user
    of its own with no capability. The agent runs as root with only the capabilities that
    starting another user's ranks takes (a non-root container gets no ambient ones), and
    its ranks as the pod's non-root user (--run-as UID:GID), who cannot read the agent's
    secrets (0400, root's; the pod's fsGroup is the ranks' group)."""
    import yaml

    docs = [d for d in yaml.safe_load_all((DEPLOY / "lazarus.yaml").read_text()) if d]
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("Deployment", "DaemonSet")}
    assert sorted(pods) == ["lazarus-agent", "lazarus-daemon"]
    for name, pod in pods.items():
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] > 0, name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and "privileged" not in sc
    daemon = pods["lazarus-daemon"]["containers"][0]["securityContext"]
    assert daemon["capabilities"] == {"drop": ["ALL"]} and "runAsUser" not in daemon
    for v in pods["lazarus-daemon"]["volumes"]:
        if "secret" in v:  # readable by the daemon's group, nobody else
            assert v["secret"]["defaultMode"] == 0o440, v["name"]

    pod = pods["lazarus-agent"]
    agent = pod["containers"][0]
    sc = agent["securityContext"]
    assert (sc["runAsUser"], sc["runAsNonRoot"]) == (0, False)
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted("CAP_" + c for c in sc["capabilities"]["add"]) == sorted(CAPABILITIES)
    args = " ".join(agent["args"])
    ranks = f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    assert f"--run-as {ranks}" in args
    assert JobUser.resolve(ranks).uid > 0  # a bare uid: no passwd entry needed in the image
    # No fsGroup: the kubelet makes Secret files readable by it whatever their mode, and no
    # service account token: either would be the ranks' to read.
    assert "fsGroup" not in pod["securityContext"]
    assert pod["automountServiceAccountToken"] is False
    for v in pod["volumes"]:
        if "secret" in v:  # root's alone
            assert v["secret"]["defaultMode"] == 0o400, v["name"]
    (init,) = pod["initContainers"]
    script = " ".join(init["args"])
    assert "install -d -m 0700 -o 0 -g 0 /var/lib/lazarus/agent" in script
    assert "chown -R 0:0 /var/lib/lazarus/agent" in script  # an older agent's, of uid 10001
    assert f"chown {ranks} /checkpoints" in script  # the ranks write there
    assert "--workdir /var/lib/lazarus/agent" in args
    assert init["securityContext"]["capabilities"]["drop"] == ["ALL"]

"""The Kubernetes manifests validate against the Kubernetes API schemas, strictly (no unknown
field), with the command README.md's "Deploy" section shows. kubernetes-validate carries its
schemas: no cluster and no network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_no_pod_of_lazarus_runs_its_code_as_root():
    """Issue 23: the agent ran as root, so did every job's code. Only the agent's init step
    that makes its host workdir its own is root, with just the capabilities that takes."""
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
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
            assert "runAsUser" not in sc and "privileged" not in sc, (name, c["name"])
        # Secrets readable by the pod's group, nobody else
        for v in pod["volumes"]:
            if "secret" in v:
                assert v["secret"]["defaultMode"] == 0o440, (name, v["name"])
    (init,) = pods["lazarus-agent"]["initContainers"]
    assert init["command"][:1] == ["install"] and "0700" in init["command"]
    assert init["command"][-1] == "/var/lib/lazarus/agent"
    agent = pods["lazarus-agent"]["containers"][0]
    assert "--workdir /var/lib/lazarus/agent" in " ".join(agent["args"])
    assert init["securityContext"]["capabilities"]["drop"] == ["ALL"]

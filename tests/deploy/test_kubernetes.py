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

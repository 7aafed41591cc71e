"""The import layers of docs/architecture.md hold (import-linter contracts in pyproject.toml).

The installed packages map lazarus.daemon/agent/trainer/proto onto top-level folders; the
linter reads a source tree, so it gets one laid out as the import names see it (symlinks).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAPPED = {"daemon": "daemon", "agent": "agent", "trainer": "trainer", "proto": "proto"}


def test_import_layers_hold(tmp_path):
    linter = Path(sys.executable).with_name("lint-imports")
    tree = tmp_path / "lazarus"
    shutil.copytree(ROOT / "lazarus", tree, ignore=shutil.ignore_patterns("__pycache__"))
    for name, folder in MAPPED.items():
        (tree / name).symlink_to(ROOT / folder, target_is_directory=True)
    proc = subprocess.run([str(linter), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout

"""Ranks whose process Lazarus does not run itself (docs/adopting.md, "Your environment"):
the rank side of Lazarus in the job's own interpreter needs nothing of the agent's
environment but torch, and a lost peer is told from a rank's own crash by its output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lazarus.core import exitcodes
from lazarus.trainer import rankboot

# What the agent's venv has and a job's need not: the rank side must import without them.
AGENT_ONLY = ("aetcd", "grpc", "google.protobuf", "psutil", "safetensors", "zstandard",
              "opentelemetry", "rich", "cryptography", "pynvml", "lazarus.agent",
              "lazarus.daemon", "lazarus.ops", "lazarus.proto")


def test_the_rank_side_imports_with_nothing_of_the_agents_environment_but_torch(tmp_path):
    code = f"""
import importlib, importlib.util, json, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in {AGENT_ONLY!r}):
            raise ImportError("not in the job's environment: " + name)
sys.meta_path.insert(0, Block())
for name in [n for n in sys.modules if n == "lazarus" or n.startswith("lazarus.")]:
    del sys.modules[name]
spec = importlib.util.spec_from_file_location("boot", sys.argv[2])
boot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boot)
sys.meta_path.insert(1, boot.RankSide(json.loads(sys.argv[1])))
import lazarus.trainer
from lazarus.trainer import collwatch, rankrun, session, teardown, inplace, exitnote
from lazarus.trainer.peerloss import is_peer_failure
exitnote.start_time(__import__("os").getpid())
print("imported", sorted(n for n in sys.modules if n.startswith("lazarus")))
"""
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(rankboot.roots()),
                           rankboot.__file__], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lazarus.trainer.rankrun" in proc.stdout


LIGHTNING_PEER = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979, in f
[rank0]:     return Variable._execution_engine.run_backward(
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank0]: RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:3766: Connection reset by peer. GLHF!
"""
OWN_CRASH = """\
Traceback (most recent call last):
  File "train.py", line 3, in <module>
    raise ValueError("lr must be positive")
ValueError: lr must be positive
"""
CHAINED = """\
Traceback (most recent call last):
  File "train.py", line 3, in <module>
torch.distributed.DistNetworkError: failed to recv, got 0 bytes

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "train.py", line 9, in <module>
KeyError: 'checkpoint'
"""


@pytest.mark.parametrize("code, output, lost", [
    (1, LIGHTNING_PEER, True),
    (1, OWN_CRASH, False),
    (1, CHAINED, False),                      # the last error is the script's own
    (1, CHAINED.partition("During")[0], True),
    (1, "DistNetworkError: failed to recv\n", False),   # no traceback: the script's own words
    (2, LIGHTNING_PEER, False),               # a script's own exit code, not an uncaught error
    (-9, LIGHTNING_PEER, False),              # killed: the fault itself
    (1, "", False),
])
def test_a_lost_peer_is_told_from_the_ranks_output(code, output, lost):
    assert exitcodes.peer_lost_in_output(code, output) is lost

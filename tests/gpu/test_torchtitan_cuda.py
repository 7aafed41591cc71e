"""TorchTitan's own trainer (`python -m torchtitan.train`, its Llama 3 debug model) under
`lazarus up` on a GPU, installed as its users install it: in a venv of its own that Lazarus is
not in, launched by that venv's python. A worker is killed and the node lost (its warm spare
takes its place, on the same GPU); every new round resumes from TorchTitan's own newest
checkpoint and the run ends at its last step. The venv's packages travel as wheels
(tests/gpu/titan-wheels.txt); its torch is the image's, reached through a path file (the
machine has no package index). The corpus and the tokenizer are made here: TorchTitan reads a
directory of JSON lines through `datasets` and a `tokenizer.json` through `tokenizers`."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "tests" / "gpu" / "wheels" / "titan"
STEPS = 3000
# each fault after this many seconds of the round that answered the one before (chaos.py:
# counted from the joining of a world of one rank, lazarus.trainer.collwatch), TorchTitan's
# setup of a few seconds included; a debug-model step on one H100/H200 takes milliseconds to
# tens of them, so both strike before step STEPS, the second after a save
CHAOS = "kill-worker@8s,kill-node@12s"
WORDS = ("the a one every some river stone light night model rank node step loss grows falls "
         "keeps runs stops heals trains waits quickly slowly again never always under over "
         "beside").split()


def build_venv(root: Path) -> Path:
    """A venv of TorchTitan's: its wheels in it; the running interpreter's torch (and the
    image's other packages) on its path by a plain path line, which, unlike a site dir, reads
    none of that directory's .pth files -- Lazarus's editable install among them."""
    venv = root / "titan-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True).stdout
    site_dir = Path(site.strip())
    (site_dir / "image-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(site_dir), *map(str, WHEELS.glob("*.whl"))],
                   check=True, timeout=300)
    return python


def make_project(root: Path, python: Path) -> Path:
    """A corpus (JSON lines), a byte-level BPE tokenizer trained on it, and TorchTitan's job
    config; returns the config's path."""
    rng = random.Random(0)
    data = root / "corpus"
    data.mkdir()
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 200))) + "."
            for _ in range(2000)]
    (data / "data.json").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = root / "tokenizer"
    tok.mkdir()
    train_tokenizer = (
        "import sys, json\n"
        "from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers\n"
        "tok = Tokenizer(models.BPE())\n"
        "tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)\n"
        "tok.decoder = decoders.ByteLevel()\n"
        "trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=['<|begin_of_text|>',"
        " '<|end_of_text|>'], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())\n"
        "texts = [json.loads(line)['text'] for line in open(sys.argv[1])]\n"
        "tok.train_from_iterator(texts, trainer)\n"
        "tok.save(sys.argv[2] + '/tokenizer.json')\n")
    subprocess.run([str(python), "-c", train_tokenizer, str(data / "data.json"), str(tok)],
                   check=True, timeout=120)
    (tok / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    config = root / "train.toml"
    config.write_text(f"""\
[job]
dump_folder = "{root / 'outputs'}"
description = "Llama 3 debug model under Lazarus"

[metrics]
log_freq = 10
enable_tensorboard = false

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "{tok}"

[optimizer]
name = "AdamW"
lr = 8e-4

[lr_scheduler]
warmup_steps = 10

[training]
local_batch_size = 8
seq_len = 2048
steps = {STEPS}
dataset = "c4_test"
dataset_path = "{data}"

[parallelism]
data_parallel_shard_degree = -1

[checkpoint]
enable = true
folder = "checkpoint"
interval = 50

[activation_checkpoint]
mode = "none"
""")
    return config


def _rank_logs(workdir: Path) -> dict[tuple[str, int], str]:
    """(node, round) -> what its rank printed."""
    return {(p.parent.parent.name, int(p.parent.name[6:])): p.read_text(errors="replace")
            for p in workdir.glob("nodes/logs/*/round-*/rank-*.log")}


@pytest.mark.timeout(480)  # run.sh gives a test 150 s
def test_torchtitan_in_its_own_venv_survives_a_crash_and_a_node_loss(tmp_path):
    if not sorted(WHEELS.glob("torchtitan-*.whl")):
        pytest.fail("no torchtitan wheel in tests/gpu/wheels/titan: run tests/gpu/fetch-wheels.sh")
    ours = subprocess.run([sys.executable, "-c", "import torchtitan"], capture_output=True)
    assert ours.returncode != 0, "torchtitan is in Lazarus's environment: this would prove nothing"
    python = build_venv(tmp_path)
    theirs = subprocess.run([str(python), "-c", "import torchtitan, torch\ntry:\n import lazarus"
                             "\nexcept ImportError: print('apart')"], capture_output=True,
                            text=True, timeout=120)
    assert theirs.stdout.strip() == "apart", theirs.stdout + theirs.stderr[-2000:]
    config = make_project(tmp_path, python)

    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "up", "--workdir", str(tmp_path / "up"),
         "--nodes", "1", "--min-nodes", "1", "--spares", "1", "--nproc-per-node", "1",
         "--summary", str(summary), "--chaos", CHAOS, "--quiet", "--timeout", "400",
         "--", str(python), "-m", "torchtitan.train", "--job.config_file", str(config)],
        capture_output=True, text=True, timeout=440)
    logs = _rank_logs(tmp_path / "up")
    last = max(logs, key=lambda k: k[1]) if logs else None
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-3000:]
                                  + (logs[last][-3000:] if last else "no rank log"))
    result = json.loads(summary.read_text())
    assert result["final_state"] == "SUCCEEDED"
    got = {r["kind"]: r for r in result["recoveries"]}
    assert set(got) == {"kill-worker", "kill-node"}, result["recoveries"]
    assert got["kill-worker"]["detected_as"] == "worker_crash"
    assert got["kill-node"]["detected_as"] == "node_lost"
    for kind, r in got.items():
        assert r["culprit"] == r["target"].split()[0], (kind, r)
        assert r["recovered_after_s"] is not None, (kind, r)

    # TorchTitan's own words: each round starts after the newest step its checkpointer saved
    rounds = sorted(logs, key=lambda k: k[1])
    starts = []
    for key in rounds:
        m = re.search(r"Training starts at step (\d+)", logs[key])
        if m is None:  # a round the next fault ended while it started
            assert key != rounds[-1], logs[key][-2000:]
            continue
        starts.append(int(m[1]))
        if int(m[1]) > 1:
            assert "Loading the checkpoint from" in logs[key], logs[key][-2000:]
    assert starts[0] == 1 and starts[-1] > 1 and starts == sorted(starts), starts
    assert len(rounds) >= 3, sorted(logs)
    assert "Training completed" in logs[rounds[-1]], logs[rounds[-1]][-2000:]
    saved = tmp_path / "outputs" / "checkpoint" / f"step-{STEPS}"
    assert (saved / ".metadata").is_file(), sorted(saved.parent.iterdir())

    # the figures, for docs/gpus.md: TorchTitan's own throughput line of the last round
    tps = [float(t.replace(",", "")) for t in re.findall(r"tps: ([\d,.]+)", logs[rounds[-1]])]
    print(f"titan: starts {starts}, recoveries "
          + ", ".join(f"{k} {r['recovered_after_s']:.1f} s" for k, r in got.items())
          + (f", median tps {sorted(tps)[len(tps) // 2]:,.0f}" if tps else ""))

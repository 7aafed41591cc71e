"""The token corpus and the sequence loader: what a resumed or resized run depends on."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from lazarus.core.errors import UserError
from lazarus.trainer import data
from lazarus.trainer.corpus import (EOD_TOKEN, build_corpus, ensure_corpus, verify_corpus,
                                    write_corpus)
from lazarus.trainer.data import SequenceLoader, TokenDataset

SEQ = 8


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Two shards of distinct increasing ids: a window is named by its first token."""
    d = tmp_path / "corpus"
    d.mkdir()
    write_corpus(d, [np.arange(0, 2001), np.arange(10_000, 11_601)], vocab_size=2**16)
    return d


def first_tokens(batches) -> list[int]:
    return [int(t) for inputs, _ in batches for t in inputs[:, 0]]


def test_dataset_windows_shift_targets_and_never_cross_shards(corpus: Path):
    ds = TokenDataset(corpus, SEQ)
    assert len(ds) == 2000 // SEQ + 1600 // SEQ
    loader = SequenceLoader(ds, seed=0, global_batch=16, dp_rank=0, dp_size=1, micro_batch=4)
    for inputs, targets in loader.next_step():
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.shape == targets.shape == (4, SEQ)
        assert (targets[:, :-1] == inputs[:, 1:]).all()
        # Consecutive ids: a window that crossed from shard 0 into shard 1 would jump.
        assert ((targets - inputs) == 1).all()


def test_resume_from_state_gives_identical_next_batches(corpus: Path):
    ds = TokenDataset(corpus, SEQ)
    make = lambda: SequenceLoader(ds, seed=7, global_batch=40, dp_rank=1, dp_size=2,
                                  micro_batch=5)
    straight = make()
    for _ in range(13):  # 450 windows / 40 per step: this crosses an epoch boundary
        straight.next_step()
    state = json.loads(json.dumps(straight.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.position() == straight.position()
    for _ in range(15):
        a, b = straight.next_step(), resumed.next_step()
        assert len(a) == len(b) == 4
        for (xa, ya), (xb, yb) in zip(a, b):
            assert (xa == xb).all() and (ya == yb).all()


def test_no_sequence_repeats_within_an_epoch_and_epochs_differ(corpus: Path):
    ds = TokenDataset(corpus, SEQ)
    loader = SequenceLoader(ds, seed=3, global_batch=32, dp_rank=0, dp_size=1, micro_batch=8)
    steps_per_epoch = len(ds) // 32
    epochs = []
    for _ in range(2):
        seen = []
        for _ in range(steps_per_epoch):
            seen += first_tokens(loader.next_step())
        epochs.append(seen)
    for seen in epochs:
        assert len(seen) == len(set(seen)) == steps_per_epoch * 32
    assert epochs[0] != epochs[1]
    assert loader.position()["epoch"] == 2


def test_all_dp_ranks_together_read_the_same_sequences_at_any_dp(corpus: Path):
    ds = TokenDataset(corpus, SEQ)
    per_dp = {}
    for dp in (1, 2, 4):
        loaders = [SequenceLoader(ds, seed=11, global_batch=32, dp_rank=r, dp_size=dp,
                                  micro_batch=2) for r in range(dp)]
        steps = []
        for _ in range(6):
            parts = [loader.next_step() for loader in loaders]
            assert all(len(p) == 32 // (dp * 2) for p in parts)  # accumulation absorbs dp
            steps.append(sorted(t for p in parts for t in first_tokens(p)))
            assert len(set(steps[-1])) == 32
        per_dp[dp] = steps
    assert per_dp[1] == per_dp[2] == per_dp[4]


def test_state_taken_at_dp4_resumes_at_dp2_on_the_same_data(corpus: Path):
    ds = TokenDataset(corpus, SEQ)
    reference = SequenceLoader(ds, seed=5, global_batch=16, dp_rank=0, dp_size=1,
                               micro_batch=16)
    at_dp4 = SequenceLoader(ds, seed=5, global_batch=16, dp_rank=3, dp_size=4, micro_batch=2)
    for _ in range(9):
        reference.next_step()
        at_dp4.next_step()
    resumed = [SequenceLoader(ds, seed=5, global_batch=16, dp_rank=r, dp_size=2, micro_batch=4)
               for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(at_dp4.state_dict())
    for _ in range(4):
        got = sorted(t for loader in resumed for t in first_tokens(loader.next_step()))
        assert got == sorted(first_tokens(reference.next_step()))


def test_position_names_the_next_window_and_skip_moves_past_it(corpus: Path):
    ds = TokenDataset(corpus, SEQ)
    a = SequenceLoader(ds, seed=1, global_batch=32, dp_rank=0, dp_size=1, micro_batch=32)
    b = SequenceLoader(ds, seed=1, global_batch=32, dp_rank=0, dp_size=1, micro_batch=32)
    pos = a.position()
    assert pos == {"epoch": 0, "first": 0, "last": 31}
    a.next_step()
    b.skip_to(pos["last"] + 1)
    assert b.position() == a.position()
    b.skip(1)
    a.next_step()
    assert first_tokens(a.next_step()) == first_tokens(b.next_step())
    # 450 windows hold 14 whole steps; the 15th step starts the next epoch at its first window.
    a.skip(11)
    assert a.position() == {"epoch": 1, "first": len(ds), "last": len(ds) + 31}


def test_loader_memory_stays_flat_over_thousands_of_steps(corpus: Path):
    ds = TokenDataset(corpus, SEQ)
    loader = SequenceLoader(ds, seed=2, global_batch=8, dp_rank=1, dp_size=2, micro_batch=2)
    for _ in range(200):  # warm up: first permutation, caches of numpy/torch
        loader.next_step()
    tracemalloc.start()
    try:
        loader.next_step()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(4000):  # about 70 epochs
            loader.next_step()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert growth < 64 * 1024, f"loader memory grew by {growth} bytes over 4000 steps"


def test_loader_rejects_state_of_another_dataset_or_seed(corpus: Path):
    ds = TokenDataset(corpus, SEQ)
    state = SequenceLoader(ds, seed=1, global_batch=8, dp_rank=0, dp_size=1,
                           micro_batch=8).state_dict()
    other_seed = SequenceLoader(ds, seed=2, global_batch=8, dp_rank=0, dp_size=1, micro_batch=8)
    with pytest.raises(UserError, match="seed"):
        other_seed.load_state_dict(state)
    other_len = SequenceLoader(TokenDataset(corpus, SEQ * 2), seed=1, global_batch=8,
                               dp_rank=0, dp_size=1, micro_batch=8)
    with pytest.raises(UserError, match="sequences"):
        other_len.load_state_dict(state)


def test_indivisible_or_oversized_global_batch_is_a_user_error(corpus: Path):
    ds = TokenDataset(corpus, SEQ)
    with pytest.raises(UserError, match="not divisible"):
        SequenceLoader(ds, seed=0, global_batch=30, dp_rank=0, dp_size=4, micro_batch=2)
    with pytest.raises(UserError, match="larger than the dataset"):
        SequenceLoader(ds, seed=0, global_batch=1024, dp_rank=0, dp_size=1, micro_batch=1)


@pytest.mark.parametrize("text", ["{not json", '{"format_version": 1}',
                                  '{"format_version": 9, "dtype": "uint16", "vocab_size": 256, '
                                  '"shards": [{"name": "shard-00000.bin", "tokens": 2001, '
                                  '"sha256": "x"}]}'])
def test_malformed_manifest_is_a_user_error_naming_it(corpus: Path, text: str):
    (corpus / "corpus.json").write_text(text)
    with pytest.raises(UserError, match="corpus.json"):
        TokenDataset(corpus, SEQ)


def test_missing_or_truncated_shard_is_a_user_error_naming_it(corpus: Path):
    shard = corpus / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(UserError, match="shard-00001.bin has"):
        TokenDataset(corpus, SEQ)
    shard.unlink()
    with pytest.raises(UserError, match="shard-00001.bin listed in .*corpus.json is missing"):
        TokenDataset(corpus, SEQ)
    with pytest.raises(UserError, match="does not exist"):
        TokenDataset(corpus.parent / "nowhere", SEQ)


def test_builtin_corpus_is_python_source_as_bytes_with_checksums(tmp_path: Path):
    manifest = build_corpus(tmp_path, max_tokens=100_000, shard_tokens=40_000)
    assert [s["tokens"] for s in manifest["shards"]] == [40_000, 40_000, 20_000]
    assert verify_corpus(tmp_path)["vocab_size"] == 256
    tokens = np.fromfile(tmp_path / "shard-00000.bin", dtype="<u2")
    assert tokens.max() < 256 and (tokens == EOD_TOKEN).any()
    text = tokens.astype(np.uint8).tobytes().split(b"\0")[1].decode()
    compile(text, "<stdlib file>", "exec")  # a whole document is a whole Python file
    raw = bytearray((tmp_path / "shard-00002.bin").read_bytes())
    raw[100] ^= 1
    (tmp_path / "shard-00002.bin").write_bytes(bytes(raw))
    with pytest.raises(UserError, match="shard-00002.bin does not match the sha256"):
        verify_corpus(tmp_path)


def _ensure(path: str) -> str:
    return str(ensure_corpus(Path(path), max_tokens=300_000))


def test_ranks_building_at_once_get_one_complete_corpus(tmp_path: Path):
    target = tmp_path / "cache" / "corpus"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_ensure, [str(target)] * 4)
    assert results == [str(target)] * 4
    assert sum(s["tokens"] for s in verify_corpus(target)["shards"]) == 300_000
    assert sorted(p.name for p in target.parent.iterdir()) == [".corpus.lock", "corpus"]


def test_cli_builds_into_the_cache_and_rejects_bad_paths(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("LAZARUS_CACHE", str(tmp_path))
    assert data.main(["--max-tokens", "50000"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"built corpus {tmp_path}") and "50,000 tokens" in out
    assert data.main(["--max-tokens", "50000"]) == 0
    assert capsys.readouterr().out.startswith("verified corpus")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        data.main([str(tmp_path / "file")])
    with pytest.raises(UserError, match="not empty"):
        data.main([str(tmp_path)])


# ---------------------------------------------------------------------------------------------
# uint32 corpora (vocabularies beyond 2**16, e.g. Llama 3's 128256)

LLAMA3_VOCAB = 128256


def test_uint32_corpus_round_trips_ids_above_uint16_exactly(tmp_path: Path):
    ids = [np.arange(65_530, 67_531), np.array([LLAMA3_VOCAB - 1, 0, 70_000] * 3)]
    manifest = write_corpus(tmp_path, ids, vocab_size=LLAMA3_VOCAB)
    assert manifest["dtype"] == "uint32"
    assert (tmp_path / "shard-00000.bin").stat().st_size == 4 * 2001
    assert verify_corpus(tmp_path)["vocab_size"] == LLAMA3_VOCAB
    ds = TokenDataset(tmp_path, SEQ)
    assert len(ds) == 2000 // SEQ + 8 // SEQ
    rows = ds.batch(range(len(ds)))
    assert rows.dtype == torch.int64
    assert rows[0].tolist() == list(range(65_530, 65_530 + SEQ + 1))
    assert rows[-1].tolist() == ids[1][:SEQ + 1].tolist()
    assert rows.max() == LLAMA3_VOCAB - 1


def test_write_corpus_picks_uint16_when_the_vocab_fits_or_takes_a_checked_dtype(tmp_path: Path):
    def write(name: str, tokens, **kw) -> dict:
        (tmp_path / name).mkdir()
        return write_corpus(tmp_path / name, [np.asarray(tokens)], **kw)

    assert write("a", np.arange(100) + 65_400, vocab_size=2**16)["dtype"] == "uint16"
    assert TokenDataset(tmp_path / "a", SEQ).batch([0])[0, 0] == 65_400
    assert write("b", np.arange(100), vocab_size=256, dtype="uint32")["dtype"] == "uint32"
    assert TokenDataset(tmp_path / "b", SEQ).batch([1])[0].tolist() == list(range(SEQ, 2 * SEQ + 1))
    with pytest.raises(UserError, match="vocab_size 70000 does not fit corpus dtype uint16"):
        write("c", [1], vocab_size=70_000, dtype="uint16")
    with pytest.raises(UserError, match="corpus dtype 'int8' is not one of uint16, uint32"):
        write("d", [1], vocab_size=256, dtype="int8")
    # A cast to uint16 would have silently turned 65536 into 0.
    with pytest.raises(UserError, match="token ids outside 0..65535"):
        write("e", [1, 65_536], vocab_size=2**16)


def test_a_version_1_uint16_corpus_written_before_uint32_still_reads(tmp_path: Path):
    # The exact layout the uint16-only code wrote (no "source" needed).
    ids = np.arange(1000, 1100, dtype="<u2")
    (tmp_path / "shard-00000.bin").write_bytes(ids.tobytes())
    (tmp_path / "corpus.json").write_text(json.dumps({
        "format_version": 1, "dtype": "uint16", "vocab_size": 32000,
        "shards": [{"name": "shard-00000.bin", "tokens": 100, "sha256": "x"}]}))
    ds = TokenDataset(tmp_path, SEQ)
    assert ds.vocab_size == 32000 and len(ds) == 99 // SEQ
    assert ds.batch([2])[0].tolist() == list(range(1016, 1016 + SEQ + 1))


@pytest.mark.parametrize("change, expect", [
    ({"dtype": "int8"}, r"corpus.json has dtype 'int8'; the dtype must be one of uint16, uint32"),
    ({"vocab_size": 70_000}, r"corpus.json has vocab_size 70000, which dtype uint16 cannot hold"),
    ({"vocab_size": 0}, r"corpus.json has vocab_size 0, which dtype uint16 cannot hold"),
    ({"dtype": "uint32"}, r"shard-00000.bin has 4002 bytes, .*corpus.json says 2001 uint32 "
                          r"tokens \(8004 bytes\)"),
    ({"shards": []}, r"corpus.json lists no shards"),
    ({"format_version": 2}, r"corpus.json has format_version 2; this Lazarus reads 1"),
])
def test_bad_dtype_vocab_or_size_is_a_user_error_naming_the_file(corpus: Path, change, expect):
    manifest = json.loads((corpus / "corpus.json").read_text())
    (corpus / "corpus.json").write_text(json.dumps({**manifest, **change}))
    with pytest.raises(UserError, match=expect):
        TokenDataset(corpus, SEQ)


def test_training_refuses_a_corpus_whose_vocab_exceeds_the_models(tmp_path: Path):
    from lazarus.trainer import launch

    write_corpus(tmp_path, [np.arange(0, 2001) % 300], vocab_size=LLAMA3_VOCAB)
    job = ["--data", str(tmp_path), "--seq-len", str(SEQ), "--global-batch", "4", "--nproc", "1"]
    # as typed: one line, exit 2, before any rank starts
    typed = subprocess.run([sys.executable, "-m", "lazarus.cli", "train", *job, "--model", "tiny",
                            "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert typed.returncode == 2 and typed.stdout == "", typed.stderr
    assert typed.stderr.startswith("lazarus train: error: ") and typed.stderr.count("\n") == 1
    assert f"vocab_size {LLAMA3_VOCAB}, more than model tiny's 256" in typed.stderr
    cfg, _ = launch.job_from_args([*job, "--model", "1b"])
    assert launch.check_inputs(cfg) is None

"""Tokenizing local text into a corpus with a tokenizer.json the tests build offline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lazarus import cli
from lazarus.core.errors import UserError
from lazarus.trainer import tokenizing as tokenize
from lazarus.trainer.data import TokenDataset, read_manifest
from lazarus.trainer.tokenizing import tokenize_corpus

tokenizers = pytest.importorskip("tokenizers")

EOT = "<|endoftext|>"
DOCS = ["The quick brown fox jumps over the lazy dog.\nTwice, even!\n",
        "def f(x):\n    return x * 2  # ünïcode too: ✓\n",
        "Lazarus restarts a training run from its last good checkpoint."]


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    """A byte-level BPE (like GPT-2's and Llama 3's): its decode gives back the exact text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text(DOCS[0])
    (d / "b.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i})
                                         for i, t in enumerate([DOCS[1], ""])) + "\n\n")
    (d / "sub" / "c.txt").write_text(DOCS[2])
    (d / "empty.txt").write_text("")
    (d / "notes.md").write_text("not a text input")
    return d


def all_tokens(corpus: Path) -> np.ndarray:
    m = read_manifest(corpus)
    np_dtype = {"uint16": "<u2", "uint32": "<u4"}[m["dtype"]]
    return np.concatenate([np.fromfile(corpus / s["name"], dtype=np_dtype) for s in m["shards"]])


def documents(tokens: np.ndarray, eod: int) -> list[list[int]]:
    assert tokens[-1] == eod
    cuts = np.flatnonzero(tokens == eod)
    return [t.tolist() for t in np.split(tokens, cuts + 1)[:-1]]


def test_tokenized_corpus_decodes_back_with_eod_between_documents(tokenizer_json, texts, tmp_path):
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    eod = tok.token_to_id(EOT)
    out = tmp_path / "corpus"
    manifest = tokenize_corpus([texts], tokenizer_json, out, shard_tokens=20)
    assert manifest["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert manifest["dtype"] == "uint16"
    assert len(manifest["shards"]) > 2 and all(s["tokens"] == 20 for s in manifest["shards"][:-1])
    # a.txt, b.jsonl (one document: its empty text is none), sub/c.txt; empty.txt and .md not.
    docs = documents(all_tokens(out), eod)
    assert [tok.decode(d[:-1], skip_special_tokens=False) for d in docs] == DOCS
    assert TokenDataset(out, 4).vocab_size == manifest["vocab_size"]


def test_a_long_text_is_encoded_in_pieces_in_bounded_batches(tokenizer_json, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize, "PIECE_BYTES", 64)
    monkeypatch.setattr(tokenize, "BATCH_CHARS", 100)
    monkeypatch.setattr(tokenize, "PROGRESS_EVERY_S", 0.0)
    # ... and a line longer than a piece, of 3-byte characters: a cut falls inside one.
    text = "".join(f"line {i}: {DOCS[i % 3]}" for i in range(200)) + "✓" * 100
    (tmp_path / "book.txt").write_text(text)
    lines: list[str] = []
    tokenize_corpus([tmp_path / "book.txt"], tokenizer_json, tmp_path / "out", log=lines.append)
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    [doc] = documents(all_tokens(tmp_path / "out"), tok.token_to_id(EOT))
    assert tok.decode(doc[:-1]) == text  # one document, one EOD, the cuts invisible
    assert lines and "MB read" in lines[-1]
    capped = tokenize_corpus([tmp_path / "book.txt"], tokenizer_json, tmp_path / "capped",
                             max_tokens=77, shard_tokens=50)
    assert [s["tokens"] for s in capped["shards"]] == [50, 27]


def test_a_vocab_beyond_uint16_gives_a_uint32_corpus_with_the_named_eod(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000, "<doc>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.jsonl").write_text('{"text": "w1 w65536 w69999"}\n{"text": "w7 nope"}\n')
    with pytest.raises(UserError, match="has none of the end-of-document tokens"):
        tokenize_corpus([tmp_path / "t.jsonl"], tmp_path / "tokenizer.json", tmp_path / "x")
    m = tokenize_corpus([tmp_path / "t.jsonl"], tmp_path / "tokenizer.json", tmp_path / "c",
                        eod_token="<doc>")
    assert m["dtype"] == "uint32" and m["vocab_size"] == 70_002
    assert all_tokens(tmp_path / "c").tolist() == [1, 65_536, 69_999, 70_001, 7, 70_000, 70_001]


def test_bad_inputs_are_one_line_user_errors(tokenizer_json, texts, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"tokenizer file .*missing.json does not exist"):
        tokenize_corpus([texts], tmp_path / "missing.json", out)
    (tmp_path / "bad.json").write_text('{"model": 3}')
    with pytest.raises(UserError, match=r"bad.json is not a tokenizer.json the tokenizers library"):
        tokenize_corpus([texts], tmp_path / "bad.json", out)
    with pytest.raises(UserError, match="the tokenizer has no token '<nope>'"):
        tokenize_corpus([texts], tokenizer_json, out, eod_token="<nope>")
    with pytest.raises(UserError, match="end-of-document id 999 is outside"):
        tokenize_corpus([texts], tokenizer_json, out, eod_id=999)
    with pytest.raises(UserError, match=r"text input .*nowhere does not exist"):
        tokenize_corpus([tmp_path / "nowhere"], tokenizer_json, out)
    (tmp_path / "void").mkdir()
    with pytest.raises(UserError, match=r"no .txt or .jsonl files in .*void"):
        tokenize_corpus([tmp_path / "void"], tokenizer_json, out)
    with pytest.raises(UserError, match=r"no text in .*empty.txt: every document is empty"):
        tokenize_corpus([texts / "empty.txt"], tokenizer_json, out)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n["a list"]\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not a JSON object with a \"text\" string"):
        tokenize_corpus([tmp_path / "bad.jsonl"], tokenizer_json, out)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt is not UTF-8 text \(.* at byte 3\)"):
        tokenize_corpus([tmp_path / "latin1.txt"], tokenizer_json, out)
    monkeypatch.setattr(tokenize, "PIECE_BYTES", 64)  # the bad byte in a later piece
    (tmp_path / "late.txt").write_bytes("✓".encode() * 30 + b"\xff")
    with pytest.raises(UserError, match=r"late.txt is not UTF-8 text \(.* at byte 90\)"):
        tokenize_corpus([tmp_path / "late.txt"], tokenizer_json, out)
    assert not out.exists()  # nothing written by a failed run, not even a temporary directory
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    tokenize_corpus([texts], tokenizer_json, out)
    with pytest.raises(UserError, match="already holds a corpus"):
        tokenize_corpus([texts], tokenizer_json, out)


def test_cli_tokenizes_and_prints_a_summary(tokenizer_json, texts, tmp_path, capsys):
    out = tmp_path / "corpus"
    assert cli.main(["corpus", str(out), "--from-text", str(texts / "a.txt"), str(texts / "sub"),
                     "--tokenizer", str(tokenizer_json), "--eod-token", EOT]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"built corpus {out}: 1 shards, ") and line.endswith(" s")
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    assert f"vocab {vocab} (uint16)" in line
    assert cli.main(["corpus", str(out), "--tokenizer", str(tokenizer_json)]) == 2
    assert "--from-text PATH... and --tokenizer FILE go together" in capsys.readouterr().err
    assert cli.main(["corpus", "--eod-token", EOT]) == 2
    assert "--eod-token and --shard-tokens go with --from-text" in capsys.readouterr().err


def test_cli_missing_tokenizer_is_one_line_and_exit_2(texts, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "corpus", str(tmp_path / "out"),
                           "--from-text", str(texts), "--tokenizer", str(tmp_path / "nope.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"lazarus corpus: error: tokenizer file {tmp_path / 'nope.json'} does not exist"]

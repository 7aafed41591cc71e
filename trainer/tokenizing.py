"""Tokenize local text into a corpus (the format in lazarus.trainer.data) with a tokenizer file.

The tokenizer is a Hugging Face ``tokenizer.json`` read by the ``tokenizers`` library (an
optional dependency, imported only here); nothing is downloaded. Inputs are files or
directories (searched for ``*.txt`` and ``*.jsonl``, in name order):

- a ``.jsonl`` file holds one document per line, the string under "text";
- any other file is one UTF-8 document. A long one is encoded in pieces of about
  `PIECE_BYTES` cut at line ends (inside a line longer than that), so memory stays bounded;
  the tokens at a cut can differ from those of the whole text (a merge across the cut is
  lost), which training does not mind. A .jsonl document is read whole.

Every document is encoded without the tokenizer's special tokens (no BOS) and followed by the
end-of-document id. Documents go to the tokenizer in batches (`encode_batch`, which runs on
all cores) and their ids into fixed-size shards, so memory is a batch and a shard whatever the
corpus size. The corpus is written into a temporary directory renamed into place at the end:
an interrupted run leaves no half corpus behind.
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from lazarus.core.errors import UserError
from lazarus.trainer.corpus import DTYPES, MANIFEST, dtype_for_vocab, write_corpus

# Tried in this order when no end-of-document token is named: Llama 3, GPT-2/NeoX, Llama 2
# and Mistral, Gemma.
EOD_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
DEFAULT_SHARD_TOKENS = 16 * 2**20  # 64 MiB of uint32 per shard
PIECE_BYTES = 64 << 10
# One encode_batch call gets this much text or this many documents, whichever comes first.
# An Encoding costs ~60 bytes per character of text in flight (measured), and bigger batches
# were not faster; 64 pieces still keep 16 cores busy.
BATCH_CHARS = 4 << 20
BATCH_DOCS = 8192
PROGRESS_EVERY_S = 10.0
TEXT_SUFFIXES = (".txt", ".jsonl")


def load_tokenizer(path: Path):
    """The `tokenizers.Tokenizer` in `path`; UserError when the library or the file is missing
    or unreadable."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("tokenizing needs the `tokenizers` package: pip install tokenizers") from None
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tokenizer file {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception for every parse error
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path} is not a tokenizer.json the tokenizers library can read "
                        f"({first})") from None


def find_eod(tokenizer, token: str | None = None) -> int:
    """The id of `token`, or of the first of EOD_TOKENS the tokenizer has."""
    if token is not None:
        eod = tokenizer.token_to_id(token)
        if eod is None:
            raise UserError(f"the tokenizer has no token {token!r} (--eod-token)")
        return eod
    for candidate in EOD_TOKENS:
        if (eod := tokenizer.token_to_id(candidate)) is not None:
            return eod
    raise UserError(f"the tokenizer has none of the end-of-document tokens "
                    f"{', '.join(EOD_TOKENS)}: name one with --eod-token")


def text_files(paths: Sequence[Path]) -> list[Path]:
    """The files to read: each file named, and the .txt/.jsonl files under each directory."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        elif path.is_file():
            found.append(path)
        else:
            raise UserError(f"text input {path} does not exist")
    if not found:
        raise UserError(f"no .txt or .jsonl files in {_names(paths)}")
    return found


def _names(paths: Sequence[Path]) -> str:
    # A shell glob can name thousands of files; a message names the first few.
    return ", ".join(map(str, paths[:3])) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _pieces(path: Path, done: list[int]) -> Iterator[tuple[str, bool]]:
    """(text, ends_a_document) of `path`, adding the bytes read to done[0]."""
    with open(path, "rb") as f:
        if path.suffix == ".jsonl":
            for lineno, raw in enumerate(f, 1):
                done[0] += len(raw)
                if not raw.strip():
                    continue
                try:
                    text = json.loads(raw)["text"]
                except (ValueError, KeyError, TypeError) as e:
                    raise UserError(f"{path}:{lineno}: not a JSON object with a \"text\" string "
                                    f"({type(e).__name__}: {e})") from None
                if not isinstance(text, str):
                    raise UserError(f"{path}:{lineno}: \"text\" is not a string")
                if text:
                    yield text, True
            return
        # Incremental: a line longer than a piece is cut too, maybe inside a character.
        decoder = codecs.getincrementaldecoder("utf-8")()
        piece: list[bytes] = []
        size = start = 0  # start: the piece's offset in the file
        while raw := f.readline(PIECE_BYTES):
            done[0] += len(raw)
            piece.append(raw)
            size += len(raw)
            if size >= PIECE_BYTES:
                yield _decode(decoder, path, b"".join(piece), start, final=False), False
                piece, size, start = [], 0, start + size
        if size or start:  # an empty file is no document; the end of a cut one still is
            yield _decode(decoder, path, b"".join(piece), start, final=True), True


def _decode(decoder, path: Path, raw: bytes, start: int, *, final: bool) -> str:
    held = len(decoder.getstate()[0])  # bytes of a character the last piece cut
    try:
        return decoder.decode(raw, final)
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e.reason} at byte "
                        f"{start - held + e.start})") from None


def _shards(files: list[Path], tokenizer, eod: int, np_dtype: str, *, shard_tokens: int,
            max_tokens: int | None, log: Callable[[str], None] | None) -> Iterator[np.ndarray]:
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # fast: no offsets
    total_bytes = sum(p.stat().st_size for p in files)
    done = [0]
    held: list[np.ndarray] = []  # ids not yet in a shard
    held_tokens = written = 0
    t0 = last_log = time.monotonic()

    def encoded(batch: list[tuple[str, bool]]) -> np.ndarray:
        ids: list[int] = []
        for enc, (_, ends) in zip(encode([t for t, _ in batch], add_special_tokens=False), batch):
            ids += enc.ids
            if ends:
                ids.append(eod)
        return np.array(ids, dtype=np_dtype)

    def batches() -> Iterator[list[tuple[str, bool]]]:
        batch, size = [], 0
        for path in files:
            for text, ends in _pieces(path, done):
                batch.append((text, ends))
                size += len(text)
                if size >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                    yield batch
                    batch, size = [], 0
        if batch:
            yield batch

    for batch in batches():
        ids = encoded(batch)
        if max_tokens is not None:
            ids = ids[:max_tokens - written - held_tokens]
        held.append(ids)
        held_tokens += len(ids)
        while held_tokens >= shard_tokens:
            flat = np.concatenate(held)
            yield flat[:shard_tokens]
            held, held_tokens = [flat[shard_tokens:]], len(flat) - shard_tokens
            written += shard_tokens
        now = time.monotonic()
        if log is not None and now - last_log >= PROGRESS_EVERY_S:
            last_log = now
            mb = done[0] / 1e6
            log(f"  {done[0] / max(total_bytes, 1):.0%} of {total_bytes / 1e6:,.0f} MB read, "
                f"{written + held_tokens:,} tokens, {mb / (now - t0):.1f} MB/s")
        if max_tokens is not None and written + held_tokens >= max_tokens:
            break
    if held_tokens:
        yield np.concatenate(held)


def tokenize_corpus(text_paths: Sequence[Path], tokenizer_json: Path, out_dir: Path, *,
                    eod_id: int | None = None, eod_token: str | None = None,
                    shard_tokens: int = DEFAULT_SHARD_TOKENS, max_tokens: int | None = None,
                    log: Callable[[str], None] | None = None) -> dict:
    """Tokenize the text under `text_paths` into a new corpus at `out_dir`; returns its manifest.

    The end-of-document id is `eod_id`, else the id of `eod_token`, else the tokenizer's own
    (EOD_TOKENS). vocab_size is the tokenizer's, added tokens included; the dtype is uint16
    when that fits, else uint32. `max_tokens` caps the corpus; `log` gets a progress line
    every PROGRESS_EVERY_S seconds. `out_dir` must not exist or be empty.
    """
    if shard_tokens < 1:
        raise UserError(f"shard_tokens must be positive, got {shard_tokens}")
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"max_tokens must be positive, got {max_tokens}")
    if eod_id is not None and eod_token is not None:
        raise UserError("give an end-of-document id or a token, not both")
    tokenizer = load_tokenizer(tokenizer_json)
    # The largest id + 1, not the entry count: a vocabulary with holes still fits the corpus.
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    eod = find_eod(tokenizer, eod_token) if eod_id is None else eod_id
    if not 0 <= eod < vocab_size:
        raise UserError(f"end-of-document id {eod} is outside the tokenizer's vocabulary "
                        f"(0..{vocab_size - 1})")
    files = text_files(text_paths)
    out_dir = Path(out_dir)
    if (out_dir / MANIFEST).is_file():
        raise UserError(f"{out_dir} already holds a corpus: pick a new directory")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} exists and is not an empty directory")
    dtype = dtype_for_vocab(vocab_size)
    shards = _shards(files, tokenizer, eod, DTYPES[dtype][0], shard_tokens=shard_tokens,
                     max_tokens=max_tokens, log=log)
    source = (f"{len(files)} text file(s) under {_names(text_paths)}, tokenized with "
              f"{tokenizer_json}, end of document {eod}")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            manifest = write_corpus(tmp, shards, vocab_size=vocab_size, source=source, dtype=dtype)
            if not manifest["shards"]:
                raise UserError(f"no text in {_names(files)}: every document is empty")
            tmp.chmod(0o755)  # mkdtemp makes it private; corpora are read by every rank
            if out_dir.is_dir():
                out_dir.rmdir()  # empty (checked above); rename cannot replace a directory
            os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise UserError(f"cannot write the corpus to {out_dir}: {e.strerror or e}") from None
    return manifest

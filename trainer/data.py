"""Token data: a corpus on disk, a memmapped dataset of fixed-length sequences, and a loader
whose position is a single cursor, so a run resumes (or reshards) without replaying or
skipping a sequence.

Built-in corpus
---------------
`ensure_corpus()` builds, once, a corpus that needs no download: the bytes of the Python
standard library's ``.py`` files (byte-level tokens 0..255, vocab 256; every document is
followed by token 0, which never occurs in source text, as a separator), capped at
`DEFAULT_MAX_TOKENS` tokens so it takes seconds. `lazarus corpus [DIR]` does the same from the
command line and prints a summary; on an existing corpus it verifies the checksums.

Corpus format (bring your own pre-tokenised shards)
---------------------------------------------------
A corpus is a directory holding raw shard files and a ``corpus.json`` manifest::

    my-corpus/
      corpus.json
      shard-00000.bin        little-endian token ids of the manifest's dtype, nothing else
      shard-00001.bin        (no header)
      ...

    corpus.json:
    {
      "format_version": 1,
      "dtype": "uint32",                 # "uint16" (vocab_size <= 65536) or "uint32"
      "vocab_size": 128256,              # every token id is < vocab_size
      "shards": [
        {"name": "shard-00000.bin", "tokens": 1048576, "sha256": "<hex digest of the file>"},
        ...
      ],
      "source": "free text describing where the tokens came from"     # optional
    }

A shard's byte size must be exactly the dtype's item size (2 or 4) x its token count. uint16
is the original (and the built-in corpus's) dtype; uint32 holds the ids of vocabularies larger
than 2**16 such as Llama 3's (128256), which the 1b and 8b presets use. `lazarus train`
refuses a corpus whose vocab_size exceeds the model's. Shard names are plain file names
inside the corpus directory. Documents are simply concatenated; put your tokenizer's
end-of-document id between them if you want the model to see boundaries. `write_corpus()`
writes this layout from numpy arrays, in uint16 when the vocabulary fits and uint32 otherwise.

`lazarus corpus OUT --from-text PATH... --tokenizer tokenizer.json` writes it from local text
files (.txt: a file is a document; .jsonl: a line's "text" is a document) with a Hugging Face
``tokenizers`` file, an end-of-document token after each document (lazarus.trainer.tokenizing).

Sequences and shuffling
-----------------------
`TokenDataset(dir, seq_len)` cuts every shard into windows of seq_len + 1 tokens with stride
seq_len (inputs = window[:-1], targets = window[1:]); a window never crosses a shard boundary.
`SequenceLoader` visits those windows in a random order drawn from (seed, epoch): each epoch is
one permutation of all windows, and an optimizer step consumes the next `global_batch` of them,
split into dp contiguous chunks (one per data-parallel rank) and each chunk into micro-batches.
The tail of an epoch too short for a whole step is skipped, so a step never straddles two
epochs. The loader's whole state is a cursor counting sequences (epoch x len + offset), which
does not depend on the dp degree: a checkpoint taken at dp=4 resumes at dp=2 on the same data.
"""

from __future__ import annotations

import argparse
import bisect
import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from lazarus.core.errors import UserError
from lazarus.trainer.ckptfiles import sha256_file

MANIFEST = "corpus.json"
# uint32 was added beside uint16 without a new version: version-1 corpora read as before.
FORMAT_VERSION = 1
# dtype name in corpus.json -> (numpy dtype of a shard, largest vocab_size it can hold)
DTYPES = {"uint16": ("<u2", 2**16), "uint32": ("<u4", 2**32)}
BYTE_VOCAB_SIZE = 256
# Separates documents of the built-in corpus; NUL never occurs in Python source.
EOD_TOKEN = 0
DEFAULT_MAX_TOKENS = 12 * 2**20
DEFAULT_SHARD_TOKENS = 4 * 2**20
CACHE_ENV = "LAZARUS_CACHE"


def default_corpus_dir() -> Path:
    cache = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lazarus"
    # Different Python versions ship different stdlib sources, hence different corpora.
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return Path(cache) / "corpus" / f"stdlib-{py}-v{FORMAT_VERSION}"


# ---------------------------------------------------------------------------------------------
# Writing a corpus


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest corpus dtype holding every id of a vocabulary of `vocab_size` tokens."""
    for name, (_, limit) in DTYPES.items():
        if 0 < vocab_size <= limit:
            return name
    raise UserError(f"vocab_size {vocab_size} must be between 1 and {2**32}")


def write_corpus(out_dir: Path, shards: Iterable[np.ndarray], *, vocab_size: int,
                 source: str = "", dtype: str | None = None) -> dict:
    """Write token arrays as shard files plus the manifest (the format in the module doc).

    `out_dir` must exist and be empty. `dtype`: "uint16" or "uint32"; None picks uint16 when
    the vocabulary fits. The manifest goes last, so a failed write leaves no corpus. Returns
    the manifest.
    """
    dtype = dtype_for_vocab(vocab_size) if dtype is None else dtype
    if dtype not in DTYPES:
        raise UserError(f"corpus dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    np_dtype, limit = DTYPES[dtype]
    if not 0 < vocab_size <= limit:
        raise UserError(f"vocab_size {vocab_size} does not fit corpus dtype {dtype} "
                        f"(at most {limit})")
    entries = []
    for i, tokens in enumerate(shards):
        tokens = np.asarray(tokens)
        # The cast below would wrap an out-of-range id silently into another token.
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise UserError(f"shard {i} holds token ids outside 0..{vocab_size - 1} "
                            f"(min {tokens.min()}, max {tokens.max()})")
        name = f"shard-{i:05d}.bin"
        data = np.ascontiguousarray(tokens, dtype=np_dtype).tobytes()
        _fsync_write(out_dir / name, data)
        entries.append({"name": name, "tokens": tokens.size,
                        "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"format_version": FORMAT_VERSION, "dtype": dtype, "vocab_size": vocab_size,
                "shards": entries, "source": source}
    _fsync_write(out_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def _stdlib_documents() -> Iterator[bytes]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        # Installed third-party packages differ between machines; the stdlib does not.
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if data and b"\0" not in data:
            yield data


def _stdlib_shards(max_tokens: int, shard_tokens: int) -> Iterator[np.ndarray]:
    buf = bytearray()
    total = 0
    for doc in _stdlib_documents():
        buf += doc
        buf.append(EOD_TOKEN)
        while len(buf) >= shard_tokens or total + len(buf) >= max_tokens:
            n = min(shard_tokens, max_tokens - total)
            yield np.frombuffer(bytes(buf[:n]), dtype=np.uint8).astype("<u2")
            del buf[:n]
            total += n
            if total >= max_tokens:
                return
    if buf:
        yield np.frombuffer(bytes(buf), dtype=np.uint8).astype("<u2")


def build_corpus(out_dir: Path, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS) -> dict:
    """Write the built-in byte-level stdlib corpus into the empty directory `out_dir`."""
    py = sysconfig.get_paths()["stdlib"]
    return write_corpus(out_dir, _stdlib_shards(max_tokens, shard_tokens),
                        vocab_size=BYTE_VOCAB_SIZE,
                        source=f"bytes of the .py files under {py} (separator {EOD_TOKEN})")


def is_corpus(path: Path) -> bool:
    """Whether `path` holds a built corpus (ensure_corpus leaves it as it is)."""
    return (path / MANIFEST).is_file()


def ensure_corpus(path: Path | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS) -> Path:
    """Return a corpus directory, building the built-in corpus there first if it has none.

    Safe when every rank calls it at once: builders on one machine queue on a lock file, and
    each build goes into a private temporary directory renamed into place in one step, so a
    reader never sees half a corpus (also across machines sharing a file system).
    """
    path = Path(path) if path is not None else default_corpus_dir()
    if (path / MANIFEST).is_file():
        return path
    if path.exists() and not path.is_dir():
        raise UserError(f"corpus path {path} exists and is not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (path / MANIFEST).is_file():
                return path
            if path.is_dir() and any(path.iterdir()):
                raise UserError(f"{path} is not a corpus (no {MANIFEST}) and is not empty; "
                                f"pick an empty or new directory")
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
            try:
                build_corpus(tmp, max_tokens=max_tokens)
                tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
                if path.is_dir():
                    path.rmdir()  # empty (checked above); rename cannot replace a directory
                os.rename(tmp, path)
            except OSError:
                # Another machine renamed its build into place first: theirs is as good.
                if not (path / MANIFEST).is_file():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise UserError(f"cannot write the corpus to {path}: {e.strerror or e}") from None
    return path


# ---------------------------------------------------------------------------------------------
# Reading a corpus


def read_manifest(corpus_dir: Path) -> dict:
    """The validated manifest of `corpus_dir`; UserError naming the file if it is unusable."""
    corpus_dir = Path(corpus_dir)
    mpath = corpus_dir / MANIFEST
    if not corpus_dir.is_dir():
        raise UserError(f"corpus directory {corpus_dir} does not exist")
    if not mpath.is_file():
        raise UserError(f"{mpath} is missing: not a corpus directory")
    try:
        m = json.loads(mpath.read_text())
        version, dtype, vocab_size = m["format_version"], m["dtype"], int(m["vocab_size"])
        shards = [(str(s["name"]), int(s["tokens"]), str(s["sha256"])) for s in m["shards"]]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{mpath} is malformed ({type(e).__name__}: {e})") from None
    if version != FORMAT_VERSION:
        raise UserError(f"{mpath} has format_version {version!r}; this Lazarus reads "
                        f"{FORMAT_VERSION}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise UserError(f"{mpath} has dtype {dtype!r}; the dtype must be one of "
                        f"{', '.join(DTYPES)}")
    itemsize, limit = np.dtype(DTYPES[dtype][0]).itemsize, DTYPES[dtype][1]
    if not 0 < vocab_size <= limit:
        raise UserError(f"{mpath} has vocab_size {vocab_size}, which dtype {dtype} cannot hold "
                        f"(1 to {limit})")
    if not shards:
        raise UserError(f"{mpath} lists no shards")
    for name, tokens, _ in shards:
        spath = corpus_dir / name
        if Path(name).name != name:
            raise UserError(f"{mpath}: shard name {name!r} must be a plain file name")
        if not spath.is_file():
            raise UserError(f"shard {spath} listed in {mpath} is missing")
        if spath.stat().st_size != itemsize * tokens:
            raise UserError(f"shard {spath} has {spath.stat().st_size} bytes, {mpath} says "
                            f"{tokens} {dtype} tokens ({itemsize * tokens} bytes)")
    return m


def verify_corpus(corpus_dir: Path) -> dict:
    """read_manifest plus the sha256 of every shard (reads everything: not done per run)."""
    m = read_manifest(corpus_dir)
    for s in m["shards"]:
        if sha256_file(Path(corpus_dir) / s["name"]) != s["sha256"]:
            raise UserError(f"shard {Path(corpus_dir) / s['name']} does not match the sha256 in "
                            f"its {MANIFEST}: the corpus is corrupt")
    return m


class TokenDataset:
    """Windows of seq_len + 1 tokens over memmapped shards; indexable, nothing loaded eagerly."""

    def __init__(self, corpus_dir: Path, seq_len: int):
        if seq_len < 1:
            raise UserError(f"seq_len must be >= 1, got {seq_len}")
        self.corpus_dir = Path(corpus_dir)
        self.seq_len = seq_len
        self.manifest = read_manifest(self.corpus_dir)
        self.vocab_size = int(self.manifest["vocab_size"])
        np_dtype = DTYPES[self.manifest["dtype"]][0]
        self._shards = [np.memmap(self.corpus_dir / s["name"], dtype=np_dtype, mode="r")
                        for s in self.manifest["shards"]]
        counts = [max(0, (len(s) - 1) // seq_len) for s in self._shards]
        # _starts[i] = index of shard i's first window.
        self._starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        if len(self) == 0:
            raise UserError(f"corpus {self.corpus_dir} has no shard longer than seq_len "
                            f"{seq_len} tokens")

    @property
    def fingerprint(self) -> str:
        """Identifies the corpus content: ranks can compare it to be sure they read the same."""
        digests = "".join(s["sha256"] for s in self.manifest["shards"])
        return hashlib.sha256(digests.encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        shard = bisect.bisect_right(self._starts, index) - 1
        begin = (index - self._starts[shard]) * self.seq_len
        return self._shards[shard][begin:begin + self.seq_len + 1]

    def batch(self, indices: Iterable[int]) -> torch.Tensor:
        """The windows at `indices` as an int64 tensor [len(indices), seq_len + 1]."""
        rows = np.stack([self[int(i)] for i in indices]).astype(np.int64)
        return torch.from_numpy(rows)


def check_model_vocab(dataset: TokenDataset, model_vocab: int, model: str) -> None:
    """UserError when the corpus may hold ids the model cannot embed: on a GPU that would
    surface as a device-side assert in the embedding, not as a message."""
    if dataset.vocab_size > model_vocab:
        raise UserError(f"corpus {dataset.corpus_dir} has vocab_size {dataset.vocab_size}, "
                        f"more than model {model}'s {model_vocab}: tokenize it for this "
                        f"model or pick a model whose vocabulary covers it")


# ---------------------------------------------------------------------------------------------
# Loading batches


def _epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    digest = hashlib.sha256(f"lazarus-data:{seed}:{epoch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(n, generator=g)


class SequenceLoader:
    """Feeds one data-parallel rank its share of each optimizer step.

    A step takes the next `global_batch` sequences of the epoch's permutation; rank r of
    `dp_size` gets the r-th contiguous chunk, cut into micro-batches of `micro_batch`
    (accumulation = global_batch / (dp_size * micro_batch)). Memory is one permutation of the
    dataset, whatever the number of steps.
    """

    def __init__(self, dataset: TokenDataset, *, seed: int, global_batch: int, dp_rank: int,
                 dp_size: int, micro_batch: int):
        if global_batch % (dp_size * micro_batch):
            raise UserError(f"global batch {global_batch} is not divisible by dp {dp_size} x "
                            f"micro-batch {micro_batch}")
        if global_batch > len(dataset):
            raise UserError(f"global batch {global_batch} is larger than the dataset "
                            f"({len(dataset)} sequences of {dataset.seq_len + 1} tokens)")
        assert 0 <= dp_rank < dp_size
        self.dataset = dataset
        self.seed = seed
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batch = micro_batch
        self._cursor = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.dp_size * self.micro_batch)

    def _window(self, cursor: int) -> tuple[int, int]:
        """(epoch, offset) of the step starting at `cursor`, moved past a too-short tail."""
        n = len(self.dataset)
        epoch, offset = divmod(cursor, n)
        if offset + self.global_batch > n:
            epoch, offset = epoch + 1, 0
        return epoch, offset

    def position(self) -> dict:
        """The data window the next step will read: its epoch and first/last sequence cursor
        (inclusive). `skip_to(position()["last"] + 1)` drops exactly that window."""
        epoch, offset = self._window(self._cursor)
        first = epoch * len(self.dataset) + offset
        return {"epoch": epoch, "first": first, "last": first + self.global_batch - 1}

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        epoch, offset = self._window(self._cursor)
        if epoch != self._perm_epoch:
            self._perm = _epoch_permutation(self.seed, epoch, len(self.dataset))
            self._perm_epoch = epoch
        per_rank = self.global_batch // self.dp_size
        begin = offset + self.dp_rank * per_rank
        mine = self._perm[begin:begin + per_rank]
        self._cursor = epoch * len(self.dataset) + offset + self.global_batch
        out = []
        for chunk in mine.split(self.micro_batch):
            rows = self.dataset.batch(chunk.tolist())
            out.append((rows[:, :-1], rows[:, 1:]))
        return out

    def skip(self, num_steps: int) -> None:
        """Advance past `num_steps` steps without reading them."""
        for _ in range(num_steps):
            epoch, offset = self._window(self._cursor)
            self._cursor = epoch * len(self.dataset) + offset + self.global_batch

    def skip_to(self, cursor: int) -> None:
        """Continue from sequence `cursor` (a value from position() or state_dict())."""
        assert cursor >= 0
        self._cursor = cursor

    def state_dict(self) -> dict:
        return {"seed": self.seed, "cursor": self._cursor, "num_sequences": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_sequences"] != len(self.dataset) or state["seed"] != self.seed:
            raise UserError(
                f"the checkpoint's data position is for {state['num_sequences']} sequences "
                f"with seed {state['seed']}; this run has {len(self.dataset)} with seed "
                f"{self.seed} (same corpus, seq_len and seed are needed to resume)")
        self._cursor = int(state["cursor"])


# ---------------------------------------------------------------------------------------------
# `lazarus corpus`


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lazarus corpus",
        description="Build the built-in byte-level corpus (the Python standard library's "
                    "sources, no download), verify an existing corpus directory, or tokenize "
                    "your own text with a tokenizer.json (--from-text, --tokenizer).")
    parser.add_argument("dir", nargs="?", type=Path, default=None,
                        help=f"corpus directory (default: {default_corpus_dir()})")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"cap on the number of tokens built (default {DEFAULT_MAX_TOKENS} "
                             f"for the built-in corpus, none with --from-text)")
    text = parser.add_argument_group(
        "tokenizing your own text", "e.g. lazarus corpus OUT --from-text books/ --tokenizer "
        "llama3/tokenizer.json (.txt: a file is a document; .jsonl: a line's \"text\" is)")
    text.add_argument("--from-text", nargs="+", type=Path, metavar="PATH",
                      help="text files, or directories searched for *.txt and *.jsonl")
    text.add_argument("--tokenizer", type=Path, metavar="FILE",
                      help="a Hugging Face tokenizer.json (needs the tokenizers package)")
    text.add_argument("--eod-token", metavar="TEXT",
                      help="the end-of-document token put after each document (default: "
                           "the tokenizer's <|end_of_text|>, <|endoftext|>, </s> or <eos>)")
    text.add_argument("--shard-tokens", type=int, metavar="N",
                      help="tokens per shard file (default 16 Mi)")
    args = parser.parse_args(argv)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UserError(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.from_text or args.tokenizer:
        return _tokenize_main(args)
    if args.eod_token is not None or args.shard_tokens is not None:
        raise UserError("--eod-token and --shard-tokens go with --from-text and --tokenizer")
    path = args.dir if args.dir is not None else default_corpus_dir()
    existed = (path / MANIFEST).is_file()
    t0 = time.perf_counter()
    ensure_corpus(path, max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS)
    m = verify_corpus(path)
    print(f"{'verified' if existed else 'built'} {_summary(path, m, t0)}")
    return 0


def _tokenize_main(args: argparse.Namespace) -> int:
    from lazarus.trainer import tokenizing as tokenize  # imports the optional tokenizers package

    if not args.from_text or args.tokenizer is None:
        raise UserError("--from-text PATH... and --tokenizer FILE go together")
    if args.dir is None:
        raise UserError("name the new corpus directory: lazarus corpus OUT --from-text ...")
    t0 = time.perf_counter()
    shard_tokens = tokenize.DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens
    tokenize.tokenize_corpus(args.from_text, args.tokenizer, args.dir, eod_token=args.eod_token,
                             shard_tokens=shard_tokens, max_tokens=args.max_tokens,
                             log=lambda line: print(line, flush=True))
    print(f"built {_summary(args.dir, read_manifest(args.dir), t0)}")
    return 0


def _summary(path: Path, m: dict, t0: float) -> str:
    tokens = sum(s["tokens"] for s in m["shards"])
    return (f"corpus {path}: {len(m['shards'])} shards, {tokens:,} tokens, "
            f"vocab {m['vocab_size']} ({m['dtype']}), {time.perf_counter() - t0:.1f} s")

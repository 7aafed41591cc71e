"""A token corpus on disk: its format, the built-in corpus, and writing, reading and verifying
one. No torch here: `lazarus up` and `lazarus corpus` build the corpus without loading it
(the ranks read it through lazarus.trainer.data).

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
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

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

"""Values only a holder of a shared key could have written: HMAC-SHA256 over the value and
where it is kept.

torch's rendezvous state is a pickle, and unpickling runs code: a value read back from etcd is
opened here, and its payload handed on, only when its tag proves a holder of the key wrote it
for this very place (`context`, e.g. the etcd key). Anything else -- a value written with
another key, without one, or cut short -- raises Forged before a byte of it is parsed.

    sealed = MAGIC + tag (32 bytes) + payload
    tag    = HMAC-SHA256(key, MAGIC + len(context) (4 bytes, big-endian) + context + payload)

The tag does not say when a value was written: someone who can write the key's place may put
back a value a holder wrote there earlier (the data is old, but it is data, not code).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from lazarus.core.errors import UserError
from lazarus.core.privatedir import read_secret_file

MAGIC = b"LZS1"
TAG_BYTES = hashlib.sha256().digest_size
# A shared secret shorter than this is a password, not a key.
MIN_KEY_CHARS = 16


class Forged(ValueError):
    """A value whose tag does not prove that a holder of the key wrote it here."""


def _tag(key: bytes, context: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, MAGIC + len(context).to_bytes(4, "big") + context, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def seal(key: bytes, context: bytes, payload: bytes) -> bytes:
    """`payload`, tagged for `context` under `key` (deterministic: sealing twice gives the same
    bytes, so a writer can recognise its own value)."""
    return MAGIC + _tag(key, context, payload) + payload


def unseal(key: bytes, context: bytes, sealed: bytes) -> bytes:
    """The payload of `sealed`; Forged unless it was sealed under `key` for `context`."""
    if len(sealed) < len(MAGIC) + TAG_BYTES or not sealed.startswith(MAGIC):
        raise Forged("it carries no tag (written without a key, or by something else)")
    tag = sealed[len(MAGIC):len(MAGIC) + TAG_BYTES]
    payload = sealed[len(MAGIC) + TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, context, payload)):
        raise Forged("its tag does not match (written with another key, or altered)")
    return payload


def tag(key: bytes, context: bytes) -> bytes:
    """A seal of `context` alone (MAGIC + tag), for a payload that carries its own digest: seal
    the digest as part of `context` and check the payload against it, instead of running the
    HMAC over hundreds of MB (lazarus.agent.replica)."""
    return MAGIC + _tag(key, context, b"")


def check(key: bytes, context: bytes, sealed_tag: bytes) -> None:
    """Forged unless `sealed_tag` is `tag(key, context)`."""
    if len(sealed_tag) != len(MAGIC) + TAG_BYTES or not sealed_tag.startswith(MAGIC):
        raise Forged("it carries no tag (written without a key, or by something else)")
    if not hmac.compare_digest(sealed_tag[len(MAGIC):], _tag(key, context, b"")):
        raise Forged("its tag does not match (written with another key, or altered)")


def load_key(*, file: str | Path | None, env: str, what: str) -> bytes | None:
    """The shared key from `file` if given, else from the environment variable `env`; None
    when neither is set. UserError for an unreadable file, one of this user's that others may
    read (lazarus.core.privatedir.read_secret_file), or a key too short to be one."""
    if file is not None:
        try:
            text = read_secret_file(file, f"{what} file", "a key").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{what} file {str(file)!r} is unreadable ({e})") from None
        source = f"{what} file {str(file)!r}"
    else:
        text = os.environ.get(env, "").strip()
        if not text:
            return None
        source = f"${env}"
    if len(text) < MIN_KEY_CHARS:
        raise UserError(f"{source} holds {len(text)} characters; a key needs at least "
                        f"{MIN_KEY_CHARS} (make one with `openssl rand -hex 32`)")
    return text.encode()

"""Tier-0 copies' encryption on the wire (lazarus.agent.replica.MessageCipher): a key of its
own per message (HKDF of the replica key and a random salt) and a random 96-bit nonce, so no
(key, nonce) pair repeats however many copies a job sends; anything altered fails its tag."""

from __future__ import annotations

import pytest
from cryptography.exceptions import InvalidTag

from lazarus.agent.replica import MessageCipher, ReplicaError

KEY = b"k" * 32
AAD = b"the message's seal, chunk 0, last"
PLAIN = b"model weights nobody else may read" * 100


def _flip(b: bytes, at: int = 0) -> bytes:
    return b[:at] + bytes([b[at] ^ 1]) + b[at + 1:]


def test_a_round_trip_through_the_header_fields():
    sender = MessageCipher.new(KEY)
    wire = sender.encrypt(0, PLAIN, AAD)
    receiver = MessageCipher.of(KEY, {"enc": "x", **sender.fields()})
    assert receiver.decrypt(0, wire, AAD) == PLAIN


def test_the_same_plaintext_twice_is_two_different_messages():
    a, b = MessageCipher.new(KEY), MessageCipher.new(KEY)
    assert a.salt != b.salt and a.iv != b.iv
    assert a.encrypt(0, PLAIN, AAD) != b.encrypt(0, PLAIN, AAD)
    # and a message's chunks are under distinct nonces: the same bytes differ too
    assert a.encrypt(0, PLAIN, AAD)[:len(PLAIN)] != a.encrypt(1, PLAIN, AAD)[:len(PLAIN)]


@pytest.mark.parametrize("tamper", ["salt", "iv", "ciphertext", "tag", "aad", "index"])
def test_anything_altered_fails_authentication(tamper):
    sender = MessageCipher.new(KEY)
    wire = sender.encrypt(3, PLAIN, AAD)
    salt, iv, aad, index = sender.salt, sender.iv, AAD, 3
    if tamper == "salt":
        salt = _flip(salt)
    elif tamper == "iv":
        iv = _flip(iv, len(iv) - 1)
    elif tamper == "ciphertext":
        wire = _flip(wire, 10)
    elif tamper == "tag":
        wire = _flip(wire, len(wire) - 1)
    elif tamper == "aad":
        aad = _flip(aad)
    else:
        index = 2
    with pytest.raises(InvalidTag):
        MessageCipher(KEY, salt, iv).decrypt(index, wire, aad)


def test_another_replica_key_cannot_read_it():
    sender = MessageCipher.new(KEY)
    with pytest.raises(InvalidTag):
        MessageCipher(b"x" * 32, sender.salt, sender.iv).decrypt(0, sender.encrypt(0, PLAIN,
                                                                                   AAD), AAD)


@pytest.mark.parametrize("fields", [{}, {"salt": "00" * 16}, {"salt": "00" * 8, "iv": "00" * 12},
                                    {"salt": 5, "iv": "00" * 12}, {"salt": "zz", "iv": "00"}])
def test_a_header_without_a_whole_salt_and_nonce_is_refused(fields):
    with pytest.raises(ReplicaError, match="without its salt and nonce"):
        MessageCipher.of(KEY, fields)

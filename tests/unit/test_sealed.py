"""Sealed values (lazarus.core.sealed): only the key's holder, for the same place, opens one."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lazarus.core.errors import UserError
from lazarus.core.sealed import Forged, load_key, seal, unseal

KEY = b"0123456789abcdef-key"
CONTEXT = b"/lazarus/v1/torchrun/job/state"


@given(st.binary(max_size=256))
def test_a_sealed_value_opens_to_what_was_sealed(payload):
    assert unseal(KEY, CONTEXT, seal(KEY, CONTEXT, payload)) == payload


@given(st.binary(min_size=1, max_size=64), st.data())
def test_any_change_to_a_sealed_value_is_refused(payload, data):
    sealed = bytearray(seal(KEY, CONTEXT, payload))
    at = data.draw(st.integers(0, len(sealed) - 1))
    sealed[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(Forged):
        unseal(KEY, CONTEXT, bytes(sealed))


@given(st.binary(max_size=128))
def test_an_unsealed_value_is_refused_whatever_it_holds(value):
    with pytest.raises(Forged):
        unseal(KEY, CONTEXT, value)


def test_another_key_or_another_place_is_refused():
    sealed = seal(KEY, CONTEXT, b"state")
    with pytest.raises(Forged, match="another key"):
        unseal(b"another key, same length", CONTEXT, sealed)
    with pytest.raises(Forged, match="another key"):
        unseal(KEY, b"/lazarus/v1/torchrun/other-job/state", sealed)
    with pytest.raises(Forged, match="carries no tag"):
        unseal(KEY, CONTEXT, sealed[:20])


def test_keys_come_from_a_file_before_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_SEAL_KEY", "e" * 20)
    keyfile = tmp_path / "key"
    keyfile.write_text("f" * 32 + "\n")
    keyfile.chmod(0o600)  # a secret, so its owner's alone (lazarus.core.privatedir)
    assert load_key(file=keyfile, env="TEST_SEAL_KEY", what="key") == b"f" * 32
    assert load_key(file=None, env="TEST_SEAL_KEY", what="key") == b"e" * 20
    monkeypatch.delenv("TEST_SEAL_KEY")
    assert load_key(file=None, env="TEST_SEAL_KEY", what="key") is None
    keyfile.write_text("short")
    with pytest.raises(UserError, match="holds 5 characters; a key needs at least 16"):
        load_key(file=keyfile, env="TEST_SEAL_KEY", what="key")

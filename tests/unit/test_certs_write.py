"""The CA's files are written under a fresh name and renamed into place: a symlink someone
planted at a key's or a certificate's path is replaced, never written through (which would
put our private key in a file of their choosing, or overwrite one of ours), and a key file
that was left readable by others comes back 0600."""

from __future__ import annotations

import os
import stat

from lazarus.core.certs import CertAuthority


def test_symlinks_planted_at_the_key_and_cert_paths_are_not_written_through(tmp_path):
    pki, elsewhere = tmp_path / "pki", tmp_path / "attacker"
    pki.mkdir()
    elsewhere.mkdir()
    victims = {}
    for name in ("ca-key.pem", "ca.pem", "client-key.pem", "client.pem"):
        victim = elsewhere / name
        victim.write_text("precious\n")
        victim.chmod(0o644)
        (pki / name).symlink_to(victim)
        victims[name] = victim
    ca = CertAuthority(pki)
    files = ca.issue("client")
    for name, victim in victims.items():
        assert victim.read_text() == "precious\n", name
        assert stat.S_ISREG(os.lstat(pki / name).st_mode), name
    assert files.key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY")
    assert stat.S_IMODE(os.stat(files.key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(pki / "ca-key.pem").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(files.cert).st_mode) == 0o644
    assert sorted(p.name for p in pki.iterdir()) == sorted(victims)  # no temporary left


def test_a_key_file_left_readable_by_others_comes_back_private(tmp_path):
    key = tmp_path / "client-key.pem"
    key.write_text("old key\n")
    key.chmod(0o644)
    CertAuthority(tmp_path).issue("client")
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY")

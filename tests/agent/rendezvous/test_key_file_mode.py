"""A job key file open to other users is used, with one WARNING saying so and how to fix it (as ssh)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from checkpoints import signing as ckpt_signing
from agent.rendezvous import signing
from agent.rendezvous.signing import exposed_mode, load_hmac_key


def test_only_the_owner_may_read_the_key() -> None:
    assert not exposed_mode(0o100600) and not exposed_mode(0o100400)
    assert exposed_mode(0o100644) and exposed_mode(0o100640) and exposed_mode(0o100602)


@pytest.mark.parametrize("loader", ["rendezvous", "snapshots"])
def test_a_key_readable_by_others_warns_once_per_file(loader: str, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / f"{loader}.key"
    path.write_bytes(b"k" * 32)
    path.chmod(0o644)
    load = (lambda: load_hmac_key(str(path), {})) if loader == "rendezvous" else (lambda: ckpt_signing.load_key(path))
    for _ in range(3):
        load()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]
    assert len(lines) == 1 and "mode 644" in lines[0] and f"chmod 600 {path}" in lines[0], lines

    private = tmp_path / f"{loader}-private.key"
    private.write_bytes(b"k" * 32)
    private.chmod(0o600)
    caplog.clear()
    (lambda: load_hmac_key(str(private), {}))() if loader == "rendezvous" else ckpt_signing.load_key(private)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "a private key says nothing"
    assert signing.MIN_KEY_BYTES == ckpt_signing.MIN_KEY_BYTES

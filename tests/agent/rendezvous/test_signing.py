"""Job-key loading and the sealed-value format."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.rendezvous import HmacKeyError, SignatureError, StateSigner, load_hmac_key


def test_round_trip_and_tamper_detection() -> None:
    signer = StateSigner(b"k" * 32)
    sealed = signer.seal(b"/key", b"payload")
    assert signer.open(b"/key", sealed) == b"payload"
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(SignatureError):
        signer.open(b"/key", tampered)


def test_unsigned_node_refuses_signed_values_with_a_hint() -> None:
    sealed = StateSigner(b"k" * 32).seal(b"/key", b"payload")
    with pytest.raises(SignatureError, match="same key"):
        StateSigner(None).open(b"/key", sealed)


def test_short_key_is_refused() -> None:
    with pytest.raises(HmacKeyError, match="at least 16"):
        StateSigner(b"short")


def test_key_from_file_then_env(tmp_path: Path) -> None:
    key_file = tmp_path / "job.key"
    key_file.write_text("secret-from-file-0123456789\n")
    assert load_hmac_key(str(key_file), env={}) == b"secret-from-file-0123456789"
    assert load_hmac_key(None, env={"ELASTIC_RDZV_HMAC_KEY_FILE": str(key_file)}) == b"secret-from-file-0123456789"
    assert load_hmac_key(None, env={"ELASTIC_RDZV_HMAC_KEY": "inline-key-abcdefgh"}) == b"inline-key-abcdefgh"
    assert load_hmac_key(None, env={}) is None


def test_missing_key_file_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(HmacKeyError, match="does not exist") as info:
        load_hmac_key(str(tmp_path / "nope.key"), env={})
    assert "\n" not in str(info.value)


def test_one_loader_and_one_error_type_for_the_job_key(tmp_path: Path) -> None:
    """The rendezvous and the snapshots read the job key with one loader and refuse a bad one
    with one type, so a tool catches either name (issue 38)."""
    from checkpoints import SnapshotKeyError
    from checkpoints.signing import load_key
    assert HmacKeyError is SnapshotKeyError and issubclass(HmacKeyError, ValueError)
    short = tmp_path / "short.key"
    short.write_text("tiny\n")
    for load in (lambda: load_hmac_key(str(short), env={}), lambda: load_key(short)):
        with pytest.raises(HmacKeyError, match="at least 16"):
            load()

"""HMAC-SHA256 envelopes for every value the rendezvous writes to etcd.

torch pickles the rendezvous state and unpickles what it reads back, so anyone who can
write the state key could run code on every agent. Each value is therefore wrapped as
``MAGIC | tag | payload`` where ``tag = HMAC(job key, etcd key || payload)``; binding the
etcd key stops a signed value from being replayed under another key. A value that fails
the check is refused before any caller sees its bytes, so it never reaches
``pickle.loads``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Mapping

from checkpoints.errors import JobKeyError
from checkpoints.signing import checked_key, load_key
# re-exported: their old home, which callers and tests import them from
from checkpoints.signing import MIN_KEY_BYTES, exposed_mode, warn_if_exposed  # noqa: F401

from elastic import contract

log = logging.getLogger(__name__)

_SIGNED = b"EV3S1"
_UNSIGNED = b"EV3U1"
_TAG_BYTES = 32

_warned_unsigned = False


class SignatureError(ValueError):
    """A value that was not written by a holder of the job key."""


HmacKeyError = JobKeyError  # one type for a bad job key, whoever reads it (checkpoints/errors.py)


class StateSigner:
    """Signs and verifies values; ``key=None`` means unsigned mode (warns once)."""

    def __init__(self, key: bytes | None) -> None:
        if key is not None:
            checked_key(key, "the rendezvous HMAC key")
        self._key = key
        if key is None:
            _warn_unsigned_once()

    @property
    def signed(self) -> bool:
        return self._key is not None

    def _tag(self, etcd_key: bytes, payload: bytes) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, etcd_key + b"\0" + payload, hashlib.sha256).digest()

    def lacks_key_for(self, value: bytes) -> bool:
        """True if ``value`` is signed and this signer has no key: a tool that sees such values
        cannot tell a forged unsigned value beside them from a real one, so it must not act."""
        return self._key is None and value[: len(_SIGNED)] == _SIGNED

    def seal(self, etcd_key: bytes, payload: bytes) -> bytes:
        if self._key is None:
            return _UNSIGNED + payload
        return _SIGNED + self._tag(etcd_key, payload) + payload

    def open(self, etcd_key: bytes, value: bytes) -> bytes:
        """The payload of ``value``, or :class:`SignatureError` if it cannot be trusted."""
        magic = value[: len(_SIGNED)]
        if self._key is None:
            if magic == _UNSIGNED:
                return value[len(_UNSIGNED):]
            if magic == _SIGNED:
                raise SignatureError(
                    "the value is HMAC-signed but this node has no job key; "
                    f"give every node the same key ({contract.HMAC_KEY_FILE_ENV} or hmac_key_file=)"
                )
            raise SignatureError("the value is not in the rendezvous format")
        if magic != _SIGNED:
            raise SignatureError(
                "the value is not HMAC-signed (written without the job key, or forged)"
            )
        body = value[len(_SIGNED):]
        tag, payload = body[:_TAG_BYTES], body[_TAG_BYTES:]
        if len(tag) != _TAG_BYTES or not hmac.compare_digest(tag, self._tag(etcd_key, payload)):
            raise SignatureError(
                "the value's HMAC does not match the job key (a different key, or forged)"
            )
        return payload


def _warn_unsigned_once() -> None:
    global _warned_unsigned
    if not _warned_unsigned:
        _warned_unsigned = True
        log.warning(
            "rendezvous state is NOT signed: anyone who can write to etcd can run code on "
            "every agent. Set %s or --rdzv-conf hmac_key_file=PATH for production.",
            contract.HMAC_KEY_FILE_ENV,
        )


def load_hmac_key(key_file: str | None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The job key from ``hmac_key_file``, ``ELASTIC_RDZV_HMAC_KEY_FILE`` or ``ELASTIC_RDZV_HMAC_KEY``
    (:func:`checkpoints.signing.load_key`, the one loader); None when none is set."""
    return load_key(key_file or None, env)[0]

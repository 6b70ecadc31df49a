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
import os
from pathlib import Path
from typing import Mapping

from .. import contract

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 16

_SIGNED = b"EV3S1"
_UNSIGNED = b"EV3U1"
_TAG_BYTES = 32

_warned_unsigned = False


class SignatureError(ValueError):
    """A value that was not written by a holder of the job key."""


class HmacKeyError(ValueError):
    """The configured job key cannot be used; the message says why."""


class StateSigner:
    """Signs and verifies values; ``key=None`` means unsigned mode (warns once)."""

    def __init__(self, key: bytes | None) -> None:
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise HmacKeyError(
                f"the rendezvous HMAC key has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
                "(e.g. head -c 32 /dev/urandom | base64 > job.key)"
            )
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


_exposed_warned: set[str] = set()


def exposed_mode(mode: int) -> bool:
    """True if a key file of this ``st_mode`` is open to its group or others (as ssh judges a
    private key): whoever can read the job key can write any value the agents will trust."""
    return bool(mode & 0o077)


def warn_if_exposed(path: Path) -> None:
    """One WARNING per key file and process if it is readable (or writable) by others."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if exposed_mode(mode) and str(path) not in _exposed_warned:
        _exposed_warned.add(str(path))
        log.warning("job key file %s is open to other users (mode %o): anyone on this host who can read it can "
                    "forge every value this job trusts; chmod 600 %s", path, mode & 0o777, path)


def load_hmac_key(key_file: str | None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The job key from ``hmac_key_file``, ``ELASTIC_RDZV_HMAC_KEY_FILE`` or ``ELASTIC_RDZV_HMAC_KEY``."""
    env = os.environ if env is None else env
    path_text = key_file or env.get(contract.HMAC_KEY_FILE_ENV)
    if path_text:
        path = Path(path_text).expanduser()
        try:
            key = path.read_bytes().strip()
        except FileNotFoundError:
            raise HmacKeyError(f"HMAC key file {str(path)!r} does not exist; fix hmac_key_file") from None
        except OSError as exc:
            raise HmacKeyError(f"cannot read HMAC key file {str(path)!r}: {exc.strerror}") from None
        if not key:
            raise HmacKeyError(f"HMAC key file {str(path)!r} is empty")
        warn_if_exposed(path)
        return key
    inline = env.get(contract.HMAC_KEY_ENV)
    return inline.strip().encode() if inline else None

"""HMAC-SHA256 signatures on snapshot manifests, under the job key.

The manifest's sha256 entries catch damage, not forgery: whoever can write the snapshot
directory could replace the files and recompute every hash. With a job key each manifest
carries ``"hmac"``, computed over its canonical bytes (everything but ``hmac`` and the
self-checksum), bound to the directory name and step so a signed manifest cannot be replayed
under another step. A store that has a key refuses a manifest without a valid signature.

The key is the one the rendezvous uses, and this module's :func:`load_key` is the one loader
both read it with (here, since this package does not depend on ``elastic``): the file named by
``ELASTIC_RDZV_HMAC_KEY_FILE``, else the value of ``ELASTIC_RDZV_HMAC_KEY``; surrounding
whitespace stripped, at least 16 bytes.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
from pathlib import Path
from typing import Mapping

from .errors import JobKeyError as SnapshotKeyError

KEY_ENV = "ELASTIC_RDZV_HMAC_KEY"
KEY_FILE_ENV = "ELASTIC_RDZV_HMAC_KEY_FILE"
MIN_KEY_BYTES = 16

# The one-line reasons a keyed store gives (its problem's kind, errors.ProblemKind.SIGNATURE, tells them apart).
UNSIGNED = "not signed with the job key (written without it, or forged)"
MISMATCH = "signature does not match the job key"

_DOMAIN = b"elastic-trainer-snapshot-manifest/v1"


class _FromEnv(enum.Enum):
    FROM_ENV = "from the environment"


FROM_ENV = _FromEnv.FROM_ENV
"""``SnapshotStore(key=FROM_ENV)`` (the default): the job key from the environment, if any."""


def checked_key(key: bytes, where: str = "the snapshot key") -> bytes:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes or None, got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise SnapshotKeyError(
            f"{where} has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
            "(e.g. head -c 32 /dev/urandom | base64 > job.key)"
        )
    return key


def load_key(key_file: str | os.PathLike[str] | None = None,
             env: Mapping[str, str] | None = None) -> tuple[bytes | None, str | None]:
    """The job key and where it came from: ``key_file``, else ``ELASTIC_RDZV_HMAC_KEY_FILE``,
    else ``ELASTIC_RDZV_HMAC_KEY``; ``(None, None)`` when none is set. A key that is set but
    unusable (missing or empty file, too short) raises :class:`SnapshotKeyError`."""
    env = os.environ if env is None else env
    if key_file is not None:
        path_text: str | None = os.fspath(key_file)
        where, fix = f"key file {path_text}", "pass the job's key file"
    else:
        path_text = env.get(KEY_FILE_ENV) or None
        where, fix = f"{KEY_FILE_ENV}={path_text}", f"fix {KEY_FILE_ENV}"
    if path_text:
        path = Path(path_text).expanduser()
        try:
            key = path.read_bytes().strip()
        except FileNotFoundError:
            raise SnapshotKeyError(f"job key file {str(path)!r} does not exist; {fix}") from None
        except OSError as e:
            raise SnapshotKeyError(f"cannot read job key file {str(path)!r}: {e.strerror or e}") from None
        if not key:
            raise SnapshotKeyError(f"job key file {str(path)!r} is empty")
        warn_if_exposed(path)
        return checked_key(key, f"job key file {str(path)!r}"), where
    inline = env.get(KEY_ENV)
    if inline:
        return checked_key(inline.strip().encode(), KEY_ENV), KEY_ENV
    return None, None


_exposed_warned: set[str] = set()


def exposed_mode(mode: int) -> bool:
    """True if a key file of this ``st_mode`` is open to its group or others (as ssh judges a
    private key): whoever can read the job key can write any value the agents will trust."""
    return bool(mode & 0o077)


def warn_if_exposed(path: Path) -> None:
    """One WARNING per key file and process if its group or others may read it."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if exposed_mode(mode) and str(path) not in _exposed_warned:
        _exposed_warned.add(str(path))
        logging.getLogger(__name__).warning(
            "job key file %s is open to other users (mode %o): anyone on this host who can read it can forge "
            "every value and snapshot this job trusts; chmod 600 %s", path, mode & 0o777, path)


def _message(dirname: str, step: int, body: bytes) -> bytes:
    return b"\0".join((_DOMAIN, dirname.encode(), str(int(step)).encode(), body))


def sign(key: bytes, dirname: str, step: int, body: bytes) -> str:
    """Hex HMAC-SHA256 of a manifest's canonical ``body`` as snapshot ``dirname`` at ``step``."""
    return hmac.new(key, _message(dirname, step, body), hashlib.sha256).hexdigest()


def problem(key: bytes, dirname: str, step: int, body: bytes, signature: str | None) -> str | None:
    """Why the manifest cannot be trusted under ``key`` (one of :data:`UNSIGNED`,
    :data:`MISMATCH`), or None when its signature is good."""
    if signature is None:
        return UNSIGNED
    if not hmac.compare_digest(signature, sign(key, dirname, step, body)):
        return MISMATCH
    return None

"""Where snapshots live: a local directory, or ``s3://bucket/prefix`` in an object store.

One parse, used by every entry point (``--snapshot-dir``, ``ElasticRun``/``Elastic``,
``python -m checkpoints``, ``elastic local``), so they cannot disagree about what counts as
a bucket. Pure string handling: no client is created here.

The scheme is exactly ``s3://``. Anything else that starts like it (``s3:/x``, ``S3://x``,
``s3:x``, ``s3//x``), alone or as the second tier, is refused (:class:`MisspeltLocationError`)
by every predicate here: taken as a directory, it trained and snapshotted into ``./s3:/x/``
and exited 0, the bucket never written. A directory of such a name is ``./s3:x``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

S3_SCHEME = "s3://"
# S3's bucket naming rules (3-63 chars, lowercase letters, digits, dots, hyphens); SeaweedFS
# and MinIO follow them too.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# What a slip of the hand makes of "s3://": any case, one slash or none, a missing colon.
_ALMOST_S3_RE = re.compile(r"^s3(?::|//)/*", re.IGNORECASE)


class LocationError(ValueError):
    """A snapshot location that cannot be used; ``str()`` is the one line to show."""


class MisspeltLocationError(LocationError):
    """A location that looks like a misspelt ``s3://`` URL; ``why`` reads after the location
    and names the spelling meant (``meant``)."""

    def __init__(self, location: str, meant: str) -> None:
        self.location, self.meant = location, meant
        escape = f" (a local directory of that name: ./{location})" if "," not in location else ""
        self.why = f"looks like a misspelt s3:// URL, so it is not taken as a directory; did you mean {meant}?{escape}"
        super().__init__(f"snapshot location {location}: {self.why}")


def _misspelt(text: str) -> str | None:
    """The ``s3://`` URL ``text`` likely means, if it looks like a misspelt one; else None."""
    m = _ALMOST_S3_RE.match(text)
    if m is None or (text.startswith(S3_SCHEME) and not text.startswith(S3_SCHEME + "/")):
        return None
    return S3_SCHEME + text[m.end():]


def check_spelling(location: str | os.PathLike[str]) -> None:
    """Raise :class:`MisspeltLocationError` for a near miss of ``s3://`` (alone or as the second
    tier of ``DIR,s3://...``). Every predicate below calls it, so no reader can take one for a
    directory."""
    text = os.fspath(location)
    meant = _misspelt(text)
    if meant is not None:
        raise MisspeltLocationError(text, meant)
    local, sep, remote = text.rpartition(",")
    meant = _misspelt(remote) if sep else None
    if meant is not None:
        raise MisspeltLocationError(text, f"{local},{meant}")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or "a/b/" (always ends with "/")

    def key(self, rel: str) -> str:
        return self.prefix + rel

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}".rstrip("/") if self.prefix else f"{S3_SCHEME}{self.bucket}"


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` names an object store rather than a directory (exactly ``s3://``);
    :class:`MisspeltLocationError` for a near miss."""
    check_spelling(location)
    return isinstance(location, str) and location.startswith(S3_SCHEME)


def split_tiers(location: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(local_dir, s3_url)`` for two tiers, ``LOCAL_DIR,s3://bucket/prefix``; None otherwise
    (:class:`MisspeltLocationError` for a near miss)."""
    check_spelling(location)
    if not isinstance(location, str):
        return None
    local, sep, remote = location.rpartition(",")
    if not sep or not local or not is_remote(remote) or is_remote(local):
        return None
    return local, remote


def uses_object_store(location: str | os.PathLike[str]) -> bool:
    """Snapshots (or their second tier) go to an object store: every node sees the same
    namespace, so there is no shared directory to check, and the store is probed at start."""
    return is_remote(location) or split_tiers(location) is not None


def parse_s3(location: str) -> S3Location:
    """``s3://bucket[/prefix]`` -> S3Location; LocationError (one line) if it is not one."""
    if not is_remote(location):
        raise LocationError(f"{location!r} is not an s3:// location")
    rest = location[len(S3_SCHEME):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise LocationError(f"snapshot location {location}: {bucket!r} is not a valid bucket name "
                            "(3-63 lowercase letters, digits, dots or hyphens)")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise LocationError(f"snapshot location {location}: '.' and '..' are not allowed in the prefix")
    return S3Location(bucket=bucket, prefix="".join(p + "/" for p in parts))

"""The one place a snapshot location becomes a store: a directory or an object store.

Every entry point opens its store and its fence through here, so ``s3://bucket/prefix``
works wherever a directory does and no caller tests for a scheme itself. Both stores
answer the same calls (save, load_latest, load, check/verify, status, prune, temp dirs,
sign) with the same meaning of "valid".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

from . import signing
from .fence import Fence
from .location import LocationError, is_remote, split_tiers, uses_object_store
from .errors import SnapshotDirError
from .store import SnapshotStore

Location = Union[str, "os.PathLike[str]"]


def open_store(location: Location, **kwargs: Any) -> Any:
    """:class:`SnapshotStore` for a directory, :class:`.s3store.S3SnapshotStore` for ``s3://``,
    :class:`.tiered.TieredStore` for ``LOCAL_DIR,s3://...``; a location that cannot be used
    (a bad bucket name, a misspelt ``s3://``) is :class:`SnapshotDirError`, one line.

    The local tier of two tiers is node-local scratch: it is created (``mkdir -p``) wherever
    it is opened, ``create=False`` too, so a node whose disk lacks it (a new node, a wiped
    disk) writes there instead of crash-looping on "does not exist" while the other nodes
    train on; one that cannot be created is :class:`SnapshotDirError`, one line."""
    try:
        tiers = split_tiers(location)
        if tiers is not None:
            from .tiered import TieredStore

            local = SnapshotStore(tiers[0], **{**kwargs, "create": True})
            return TieredStore(local, open_store(tiers[1], **kwargs))
        if is_remote(location):
            from .s3store import S3SnapshotStore  # boto3 only when an object store is used

            return S3SnapshotStore(str(location), **kwargs)
    except LocationError as e:
        raise SnapshotDirError(str(e)) from None
    return SnapshotStore(location, **kwargs)


def open_fence(location: Location, store: Any = None, key: Any = signing.FROM_ENV) -> Any:
    """The fence of ``location`` (``store``: an open S3 store, to reuse its client; ``key``: the
    job key a directory's fence is signed with, from the environment by default)."""
    if uses_object_store(location):
        fence = getattr(store, "fence", None)
        if fence is not None:
            return fence
        tiers = split_tiers(location)
        return open_store(tiers[1] if tiers else location, create=False, key=None).fence
    return Fence(location, key=key)


def location_of(value: str | os.PathLike[str]) -> str | Path:
    """A user's ``--snapshot-dir``/``snapshot_dir`` as the store wants it: the URL untouched
    (a Path would fold ``s3://`` into ``s3:/``), anything else as a Path; LocationError (one
    line) for a misspelt ``s3://``, which no Path may stand for."""
    return str(value) if uses_object_store(value) else Path(value)

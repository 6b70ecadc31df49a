"""The few private names of ``torch.distributed.checkpoint.filesystem`` a sharded snapshot needs.

A sharded snapshot is written in DCP's own file layout, so that a user can ``dcp.load`` it
with torch's stock ``FileSystemReader``; that reader finds each item through a
``_StorageInfo`` (file, offset, length) in the pickled ``.metadata``. torch has no public
name for that record, so it is imported here, once, and ``tests/checkpoints/
test_dcp_private.py`` fails loudly when torch renames or reshapes it. Where it is missing,
:data:`PROBLEM` says so and the run takes the gathered snapshot (rank 0 writes the full
state) instead of failing.
"""

from __future__ import annotations

from typing import Any

PROBLEM: str | None = None
METADATA_NAME = ".metadata"  # what FileSystemReader opens
SUFFIX = ".distcp"  # the suffix FileSystemWriter gives each rank's file
VERSION = "1.0.0"  # the metadata version this layout is (CURRENT_DCP_VERSION)

try:
    from torch.distributed.checkpoint import filesystem as _fs

    _StorageInfo: Any = _fs._StorageInfo
    METADATA_NAME = str(getattr(_fs, "_metadata_fn", METADATA_NAME))
    SUFFIX = str(getattr(_fs, "DEFAULT_SUFFIX", SUFFIX))
    VERSION = str(getattr(_fs, "CURRENT_DCP_VERSION", VERSION))
    _fields = getattr(_StorageInfo, "__dataclass_fields__", {})
    if not {"relative_path", "offset", "length"} <= set(_fields):
        PROBLEM = f"torch's DCP _StorageInfo has fields {sorted(_fields)}, not relative_path/offset/length"
except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the torch build
    _StorageInfo = None
    PROBLEM = f"torch's DCP filesystem layout is not available ({e})"


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """Where one item lies: ``length`` bytes at ``offset`` of ``relative_path`` (DCP's record)."""
    if _StorageInfo is None:  # pragma: no cover
        raise RuntimeError(PROBLEM)
    return _StorageInfo(relative_path, offset, length)


__all__ = ["METADATA_NAME", "PROBLEM", "SUFFIX", "VERSION", "storage_info"]

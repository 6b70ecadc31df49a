"""Is this snapshot from this model? Answered before load_state_dict's wall of text."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .errors import SnapshotMismatchError

_MAX_NAMED = 5


def check_state_compatible(expected: Mapping[str, Any], loaded: Mapping[str, Any], what: str) -> None:
    """Raise SnapshotMismatchError naming missing, unexpected and shape-mismatched keys.

    ``expected`` is the live object's state_dict, ``loaded`` the snapshot's. At most five
    entries are named, then "and N more", so the message stays one readable line.
    """
    missing = [k for k in expected if k not in loaded]
    extra = [k for k in loaded if k not in expected]
    shapes = []
    for k, v in expected.items():
        w = loaded.get(k)
        if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and v.shape != w.shape:
            shapes.append(f"{k} (snapshot {list(w.shape)} vs live {list(v.shape)})")
    if not (missing or extra or shapes):
        return
    items = (
        [f"missing {k}" for k in missing]
        + [f"unexpected {k}" for k in extra]
        + [f"shape mismatch {s}" for s in shapes]
    )
    named = ", ".join(items[:_MAX_NAMED])
    more = f" and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else ""
    raise SnapshotMismatchError(
        f"snapshot {what} does not match this {what}: {named}{more}; "
        "the snapshot was written by a different model - point the job at this model's "
        "snapshot directory or start with an empty one"
    )

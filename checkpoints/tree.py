"""Walking the nested state a trainer hands us (state_dicts, sampler dicts, RNG dicts).

Everything saved must load under ``torch.load(weights_only=True)``; checking the types
up front turns "the snapshot I need at 3 a.m. does not load" into an error at save time
that names the offending entry.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

from .errors import SnapshotError

if TYPE_CHECKING:
    import torch


@functools.cache
def _scalars() -> tuple[type, ...]:
    # torch imported at the first walk, not with the module: the store's readers never walk
    import torch

    return (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def map_state(obj: Any, leaf: Callable[[torch.Tensor, str], Any], where: str = "state") -> Any:
    """Rebuild ``obj`` with fresh containers, passing every tensor through ``leaf``.

    Fresh containers matter for the async writer: the trainer may mutate its own dicts
    and lists (``optimizer.state_dict()`` shares per-param dicts) right after ``submit``.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        return leaf(obj, where)
    if isinstance(obj, _scalars()):
        return obj
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, map_state(v, leaf, f"{where}[{k!r}]")) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: map_state(v, leaf, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        items = [map_state(v, leaf, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise SnapshotError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which snapshots cannot store; "
        "store tensors, numbers, strings, bools, None and dict/list/tuple of them "
        "(e.g. convert a numpy array with torch.from_numpy)"
    )


def check_state(state: Any) -> None:
    for k in state:
        if not isinstance(k, str):
            raise SnapshotError(f"top-level state key {k!r} is not a str; name each part, e.g. {{'model': ...}}")
    map_state(state, _check_tensor)


def _check_tensor(t: torch.Tensor, where: str) -> torch.Tensor:
    import torch

    if t.is_sparse or t.is_quantized or t.layout != torch.strided:
        raise SnapshotError(f"{where} has layout {t.layout}; only dense tensors are supported (call .to_dense())")
    return t


def iter_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_state(obj, lambda t, _w: out.append(t))
    return out


def tensor_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))

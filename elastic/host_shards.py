"""A sharded snapshot's shards taken from this rank's host copy of their step (issue 52 item 3).

With peer copies on, a rank already holds a complete host copy of its own shards of a step
(:mod:`elastic.inplace.peer_copies`: ``capture_local``'s tree, copied off the device once).
A sharded snapshot of that step (:mod:`elastic.sharded_snapshots`) then needs no second
copy: ``dcp.save`` still plans on the live ``DTensor`` state dict, exactly as without
copies (the same plan, the same ``.metadata``, the same files: a reader cannot tell), and
only the bytes of each write item are taken from the host copy instead of copied again.

Which host tensor is which item's: the live local shards at the snapshot (``capture_local``
now) and the host copy (``capture_local`` then, the same step, no load since) are the same
tree, so they pair by position; each pair must agree in shape and dtype, or nothing is
taken. An item is then found by its live tensor's storage, offset, shape and strides
(DCP's planner resolves a DTensor item to its local shard, the very view ``capture_local``
takes); one not found (a view of another extent) is copied as before, never guessed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from checkpoints.tree import iter_tensors

Key = tuple[str, int, int, tuple[int, ...], tuple[int, ...], torch.dtype]
Stage = Callable[[Any, torch.Tensor], torch.Tensor]


def _key(t: torch.Tensor) -> Key:
    return (str(t.device), t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


class HostShards:
    """This rank's host copy of a step, indexed by the live tensors it is a copy of."""

    def __init__(self, by_live: dict[Key, torch.Tensor]) -> None:
        self._by_live = by_live
        self.taken_bytes = 0  # of the snapshot's tensor items: written from the host copy as they are
        self.copied_bytes = 0  # ... and copied (an item the host copy does not hold)

    @classmethod
    def pair(cls, live: Any, host: Any) -> HostShards | None:
        """``live``: the local shards now; ``host``: a host copy of the same tree (None: the
        trees differ, and the snapshot copies its own, as without copies)."""
        lives, hosts = iter_tensors(live), iter_tensors(host)
        if len(lives) != len(hosts):
            return None
        by_live: dict[Key, torch.Tensor] = {}
        for a, b in zip(lives, hosts):
            if a.shape != b.shape or a.dtype != b.dtype or b.device.type != "cpu":
                return None
            by_live.setdefault(_key(a), b)
        return cls(by_live)

    def stage(self, otherwise: Stage) -> Stage:
        """``DeferredDcpWriter``'s stage: an item's host copy as it is (nothing writes to a host
        copy again), else ``otherwise`` (the copy made without host copies)."""
        def stage(index: Any, data: torch.Tensor) -> torch.Tensor:
            size = data.numel() * data.element_size()
            held = self._by_live.get(_key(data))
            if held is None or held.stride() != data.stride():
                self.copied_bytes += size
                return otherwise(index, data)
            self.taken_bytes += size
            return held
        return stage


def host_shards(fed: Any, step: int, tag: Any, live: Callable[[], Any]) -> HostShards | None:
    """The host copy a sharded snapshot of ``step`` takes its shards from, or None (it copies
    its own): ``fed`` (:attr:`elastic.inplace.peer_copies.PeerCopies.fed`, set only once a copy
    is complete) must be of that very step and of the state as it stands (``tag``: the same
    loads since; :func:`elastic.inplace.peer_copies.copy_for_snapshot`), and its model and
    optimizer shards the same tree as ``live()`` (this rank's local shards now)."""
    from .inplace.peer_copies import copy_for_snapshot

    copy = copy_for_snapshot(fed, step, tag)
    if copy is None:
        return None
    own = copy.payload.get("state") if isinstance(copy.payload, dict) else None
    if not isinstance(own, dict) or "model" not in own or "optimizer" not in own:
        return None
    model, optimizer = live()
    return HostShards.pair({"model": model, "optimizer": optimizer},
                           {"model": own["model"], "optimizer": own["optimizer"]})


__all__ = ["HostShards", "host_shards"]

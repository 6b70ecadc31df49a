"""A rank's state as a short list of 64-bit hashes: what replicas compare.

``torch.hash_tensor`` (torch >= 2.14) XOR-reduces a tensor's elements after upcasting each
to its 64-bit float or integer form and reinterpreting the bits: one pass over memory, on
the tensor's own device, with no copy. A single flipped bit (any odd number of flips of
one bit position) always changes it; an even number of flips of the same bit position in
different elements of one tensor cancels, and so does a permutation of elements. Silent
data corruption is a rare single event, so that is the right trade for a check run every
few hundred steps (docs/reliability.md). Where ``hash_tensor`` is missing, a BLAKE2b of
the bytes stands in (slower: the bytes go through the host). The method is part of what
the ranks compare, so ranks that hash differently are told apart from corruption.

The fingerprint is per tensor, in a fixed order, and grouped (parameters, optimizer
state, registered state), so a mismatch can name the tensors that differ; the ranks
exchange only one digest per group (:func:`digests`). Under HSDP each rank hashes its own
shards (a DTensor's local tensor) and compares them within its shard's class, the ranks
of the same local rank (:func:`..vote.vote_by_class`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from checkpoints.tree import map_state

HASH_TENSOR, BLAKE2B = 1, 2  # which method made a fingerprint (ranks must use the same)
GROUPS = ("parameters", "optimizer", "registered")
_MASK = (1 << 64) - 1
_hash_tensor = getattr(torch, "hash_tensor", None)
METHOD = HASH_TENSOR if _hash_tensor is not None else BLAKE2B


def tensor_hash(t: torch.Tensor) -> torch.Tensor:
    """A 64-bit hash of ``t``'s values as an int64 scalar tensor on ``t``'s device (no sync)."""
    t = t.detach()
    if METHOD == HASH_TENSOR:
        assert _hash_tensor is not None
        return _hash_tensor(t).view(torch.int64)
    raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return torch.tensor(_signed(int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")))


def value_hash(value: Any) -> int:
    """A plain registered value (a number, a string): a stable 64-bit hash of its repr."""
    return _signed(int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little"))


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


@dataclass
class Fingerprint:
    """Per-entry hashes, in a fixed order, each entry in one of :data:`GROUPS`."""

    names: list[str]
    groups: list[int]  # index into GROUPS, per entry
    hashes: list[int]  # int64 per entry
    finite: bool = True  # every parameter holds finite values (NaN and Inf are told apart from corruption)

    def digests(self) -> list[int]:
        """``[METHOD, digest per group]``: what the ranks all-gather. Each group's digest
        weights its entries by position (a swap of two tensors changes it)."""
        out = [0] * len(GROUPS)
        for i, (g, h) in enumerate(zip(self.groups, self.hashes)):
            out[g] = (out[g] + (h & _MASK) * (2 * i + 0x9E3779B97F4A7C15)) & _MASK
        return [METHOD, *(_signed(d) for d in out)]

    def without(self, names: set[str]) -> "Fingerprint":
        keep = [i for i, n in enumerate(self.names) if n not in names]
        return Fingerprint([self.names[i] for i in keep], [self.groups[i] for i in keep],
                           [self.hashes[i] for i in keep], self.finite)

    def differing(self, other: "Fingerprint") -> list[str]:
        """Names of the entries whose hash differs from ``other``'s (all, if they do not line up)."""
        if self.names != other.names:
            return sorted(set(self.names) ^ set(other.names)) or ["(the state's structure)"]
        return [n for n, a, b in zip(self.names, self.hashes, other.hashes) if a != b]


def fingerprint(module: nn.Module, optimizer: torch.optim.Optimizer, registered: dict[str, Any] | None) -> Fingerprint:
    """Parameters (not buffers: DDP ranks update BatchNorm's running stats from their own
    batch), the optimizer's per-parameter state, and the loop's registered state.

    Also whether every tensor is finite: a NaN's bits are whatever the op that made it
    left (its sign and payload vary), so two replicas that both went NaN may hash alike or
    not. The flag, not the hash, tells non-finite values apart (:func:`..vote.vote`). Its
    cost is one float64 sum per tensor (a NaN or Inf propagates; finite float32 values
    cannot overflow it), read back with the hashes in the same copy."""
    names: list[str] = []
    groups: list[int] = []
    pending: list[torch.Tensor | int] = []
    sums: list[torch.Tensor] = []

    def add(name: str, group: int, value: Any) -> None:
        names.append(name)
        groups.append(group)
        value = _own(value)
        if not isinstance(value, torch.Tensor):
            pending.append(value_hash(value))
            return
        pending.append(tensor_hash(value))
        if value.is_floating_point():
            sums.append(value.detach().sum(dtype=torch.float64))
        elif value.is_complex():
            sums.append(torch.view_as_real(value.detach()).sum(dtype=torch.float64))

    param_names = {id(p): n for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        add(n, 0, p)
    for p, state in optimizer.state.items():
        for key, value in sorted(state.items()):
            add(f"{param_names.get(id(p), '?')}.{key}", 1, value)
    if registered:
        for where, value in _leaves(registered):
            add(where, 2, value)
    flags = _finite_flags(sums)
    ints = _to_ints(pending + flags)
    return Fingerprint(names, groups, ints[: len(pending)], all(ints[len(pending):]))


def _finite_flags(sums: list[torch.Tensor]) -> list[torch.Tensor | int]:
    """One int64 flag per device (1: all finite), read back with the hashes (no extra sync)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for s in sums:
        by_device.setdefault(s.device, []).append(s)
    return [torch.isfinite(torch.stack(v)).all().to(torch.int64) for v in by_device.values()]


def nonfinite_entries(module: nn.Module, optimizer: torch.optim.Optimizer,
                      registered: dict[str, Any] | None) -> list[str]:
    """The entries (named as :func:`fingerprint` names them) holding a NaN or an Inf: the
    rare path of a failed check, so one look per tensor is fine."""
    out: list[str] = []

    def bad(t: Any) -> bool:
        t = _own(t)
        return (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
                and not bool(torch.isfinite(t.detach()).all()))

    param_names = {id(p): n for n, p in module.named_parameters()}
    out += [n for n, p in module.named_parameters() if bad(p)]
    for p, state in optimizer.state.items():
        out += [f"{param_names.get(id(p), '?')}.{key}" for key, value in sorted(state.items()) if bad(value)]
    if registered:
        out += [where for where, value in _leaves(registered) if bad(value)]
    return out


def _own(value: Any) -> Any:
    """A DTensor's local shard (HSDP: this rank's own bits; hashing the DTensor itself would
    dispatch a collective per tensor); anything else as it is."""
    if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            return value.to_local()
    return value


def _leaves(tree: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """Every tensor and plain value in the registered tree, with where it is."""
    out: list[tuple[str, Any]] = []

    def walk(obj: Any, where: str) -> None:
        if isinstance(obj, dict):
            for k in obj:
                walk(obj[k], f"{where}[{k!r}]")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{where}[{i}]")
        else:
            out.append((where, obj))

    for name, value in tree.items():
        walk(map_state(value, lambda t, _w: t), f"registered {name!r}")
    return out


def _to_ints(pending: list[torch.Tensor | int]) -> list[int]:
    """One device-to-host copy for all the tensor hashes (not one sync per tensor)."""
    tensors = [(i, h) for i, h in enumerate(pending) if isinstance(h, torch.Tensor)]
    out = [h if isinstance(h, int) else 0 for h in pending]
    if tensors:
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for i, h in tensors:
            by_device.setdefault(h.device, []).append((i, h))
        for items in by_device.values():
            values = torch.stack([h for _, h in items]).cpu().tolist()
            for (i, _), v in zip(items, values):
                out[i] = int(v)
    return out


__all__ = ["BLAKE2B", "Fingerprint", "GROUPS", "HASH_TENSOR", "METHOD", "fingerprint", "nonfinite_entries", "tensor_hash",
           "value_hash"]

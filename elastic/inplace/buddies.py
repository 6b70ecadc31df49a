"""Who keeps whose copy: a ring over nodes, never a rank of the same node.

A model sharded across every node (FSDP2 on a 1-D mesh) has no replica: each rank's shards
exist once. :mod:`.peer_copies` keeps a copy of every rank's state in the host memory of a
*buddy* on another node, so that a lost node's state outlives it. The buddy of node ``k``'s
``i``-th rank is node ``k+1``'s ``i``-th rank (modulo its rank count), nodes in the order
they hold ranks: a node's copies all go to the next node, and it holds the previous node's.
A copy on the same node would die with it, so a world of one node has no buddies at all.

The assignment is a function of the world only (ranks by node), so every rank computes the
same one with no message, and it is assigned again whenever the world changes.

Pure: no torch, no I/O (unit-tested in milliseconds).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence


def ranks_by_node(node_of_rank: Sequence[int]) -> list[list[int]]:
    """Ranks grouped by node (``node_of_rank[r]``: any id of rank ``r``'s node), nodes in the
    order of their lowest rank, ranks ascending."""
    groups: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        groups.setdefault(node, []).append(rank)
    return sorted(groups.values(), key=lambda ranks: ranks[0])


def ring(nodes: Sequence[Sequence[int]]) -> dict[int, int]:
    """rank -> the rank on the next node that keeps its copy (empty with fewer than two nodes)."""
    nodes = [list(ranks) for ranks in nodes if ranks]
    if len(nodes) < 2:
        return {}
    out: dict[int, int] = {}
    for k, ranks in enumerate(nodes):
        following = nodes[(k + 1) % len(nodes)]
        for i, rank in enumerate(ranks):
            out[rank] = following[i % len(following)]
    return out


def held_by(buddies: Mapping[int, int]) -> dict[int, list[int]]:
    """holder -> the ranks whose copies it keeps (ascending): one each on even nodes, more on
    a node with fewer ranks than the one before it."""
    out: dict[int, list[int]] = {}
    for rank, holder in sorted(buddies.items()):
        out.setdefault(holder, []).append(rank)
    return out


def every_k(copy_seconds: float, step_seconds: float, goal: float) -> int:
    """The fewest steps between copies that keeps their cost (``copy_seconds`` each, taken
    out of the step) within ``goal`` (a fraction) of a step of ``step_seconds``; at least 1."""
    if copy_seconds <= 0 or step_seconds <= 0 or goal <= 0:
        return 1
    return max(1, math.ceil(copy_seconds / (goal * step_seconds) - 1e-9))


def memory_problem(state_bytes: int, ranks_on_node: int, available_bytes: int | None) -> str | None:
    """Why this node cannot keep copies (None: it can). Each rank holds its own copy and one
    buddy's, and during an exchange the next of each until it is complete (never a torn one):
    at most ``4 * state_bytes`` per rank, for the ``ranks_on_node`` ranks of the node.
    ``available_bytes`` None: unknown, assumed enough."""
    if available_bytes is None:
        return None
    need = 4 * state_bytes * max(1, ranks_on_node)
    if need <= available_bytes:
        return None
    return (f"peer copies need up to {need / 2**20:.0f} MiB of host memory on this node ({ranks_on_node} rank(s) x "
            f"4 x {state_bytes / 2**20:.1f} MiB: its own state and a buddy's, each twice during a copy) and "
            f"{available_bytes / 2**20:.0f} MiB are available")


__all__ = ["every_k", "held_by", "memory_problem", "ranks_by_node", "ring"]

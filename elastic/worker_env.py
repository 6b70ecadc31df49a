"""torchrun's rank variables for a worker whose world changes under it.

The agent writes ``RANK``, ``WORLD_SIZE``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE`` (and their
``ROLE_``/``GROUP_`` twins) into a worker's environment when it starts it. A worker that
recovers in place outlives that world: when rank 0's node dies, a survivor becomes rank 0,
while its environment would still hold its start-up rank, and code that reads the
environment late (``if os.environ["RANK"] == "0"``, a logging filter, a library's own
check) would act for a rank that is no longer its own. So the membership rewrites them at
every re-formation (:func:`update_env`), from the same facts the agent used
(:func:`rank_env`: one mapping for both sides). ``LOCAL_RANK`` never changes in place, and
``MASTER_ADDR``/``MASTER_PORT`` describe only the start-up world's store.

``ElasticRun`` gives the same values as ``run.rank``, ``run.world_size`` and the like,
which is what new code should read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import MutableMapping


@dataclass(frozen=True)
class Place:
    """A worker's place in one world."""

    rank: int
    world_size: int
    group_rank: int  # the node's index in the round
    group_world_size: int  # nodes in the round
    local_world_size: int  # workers on this node
    round: int = -1  # the rendezvous round (-1: not known)


def rank_env(place: Place) -> dict[str, str]:
    """The variables that depend on the world, as torchrun names them."""
    env = {
        "RANK": str(place.rank), "ROLE_RANK": str(place.rank),
        "WORLD_SIZE": str(place.world_size), "ROLE_WORLD_SIZE": str(place.world_size),
        "GROUP_RANK": str(place.group_rank), "GROUP_WORLD_SIZE": str(place.group_world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
    }
    if place.round >= 0:
        env["ELASTIC_ROUND"] = str(place.round)
    return env


def update_env(place: Place, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Write ``place`` into the environment (this process's by default); returns what changed."""
    environ = os.environ if environ is None else environ
    changed = {k: v for k, v in rank_env(place).items() if environ.get(k) != v}
    environ.update(changed)
    return changed


__all__ = ["Place", "rank_env", "update_env"]

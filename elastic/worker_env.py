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

A worker started into a world that is already training in place (a *joiner*) gets a
different start-up world: :func:`setup_world_env`, the workers its agent starts together
and nobody else, with a store of their own. Its script's ``init_process_group()`` and its
set-up collectives then complete among those workers at once, instead of waiting for
peers that called theirs long ago (and never will again) or meeting the survivors' step
collectives; ``ElasticRun`` joins the real world at the loop's first batch
(:data:`SETUP_WORLD_ENV` tells it so), and :func:`update_env` then writes the real values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Sequence

from . import contract


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
        env[contract.ROUND_ENV] = str(place.round)
    return env


SETUP_WORLD_ENV = contract.SETUP_WORLD_ENV  # "1": this worker joins a live world at its loop's first batch


def joins_live_world(peers_in_place: Mapping[str, bool], node: str) -> bool:
    """Whether workers this node starts now join a world that already trains in place: some
    other member of the round runs in-place workers that hold state (their agent says so in
    its registry record). At a job's first start nobody does, and the whole world forms at
    once, set-up included."""
    return any(flag for name, flag in peers_in_place.items() if name != node)


def setup_world_env(local_rank: int, started: Sequence[int], port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """torchrun's variables for a set-up world of the local ranks ``started`` together (a joiner's
    world before its first step): ranks in local-rank order, its store on ``host:port``."""
    ranks = sorted(started)
    size = str(len(ranks))
    rank = str(ranks.index(local_rank))
    return {"RANK": rank, "ROLE_RANK": rank, "WORLD_SIZE": size, "ROLE_WORLD_SIZE": size, "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": size, "MASTER_ADDR": host, "MASTER_PORT": str(port),
            SETUP_WORLD_ENV: "1"}


def in_setup_world(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(SETUP_WORLD_ENV) == "1"


def update_env(place: Place, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Write ``place`` into the environment (this process's by default); returns what changed."""
    environ = os.environ if environ is None else environ
    changed = {k: v for k, v in rank_env(place).items() if environ.get(k) != v}
    environ.update(changed)
    environ.pop(SETUP_WORLD_ENV, None)  # the real world now: its own variables from here on
    return changed


__all__ = ["Place", "SETUP_WORLD_ENV", "in_setup_world", "joins_live_world", "rank_env", "setup_world_env",
           "update_env"]

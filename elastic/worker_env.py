"""A worker's environment, typed: what the agent gives each worker and what a worker reads.

:class:`WorkerEnv` is built on the agent's side (:meth:`WorkerEnv.to_env`) and parsed on the
worker's (:func:`read`), so each variable of the contract (:mod:`elastic.contract`) has one
writer and one parser, with the default a worker under plain torchrun gets. Its parts:
:class:`NodeEnv`, what every worker of a node gets, warm standbys included (they start
before they know their rank); :class:`RankEnv`, torchrun's per-worker variables and ours.
Values that change under a running worker (its ranks, in place) are read where used, not
cached: :func:`read` parses the environment as it is now.

**A worker whose world changes under it.** The agent writes ``RANK``, ``WORLD_SIZE``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE`` (and their
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
different start-up world: :meth:`RankEnv.in_setup_world`, the workers its agent starts together
and nobody else, with a store of their own. Its script's ``init_process_group()`` and its
set-up collectives then complete among those workers at once, instead of waiting for
peers that called theirs long ago (and never will again) or meeting the survivors' step
collectives; ``ElasticRun`` joins the real world at the loop's first batch
(``contract.SETUP_WORLD_ENV`` tells it so), and :func:`update_env` then writes the real values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping, MutableMapping, Sequence

from . import contract


@dataclass(frozen=True)
class Place:
    """A worker's place in one world."""

    rank: int
    world_size: int
    group_rank: int  # the node's index in the round
    group_world_size: int  # nodes in the round
    local_world_size: int  # workers on this node (0 when parsed: not known)
    round: int = -1  # the rendezvous round (-1: not known)


def rank_env(place: Place) -> dict[str, str]:
    """The variables that depend on the world, as torchrun names them."""
    env = {
        contract.RANK_ENV: str(place.rank), contract.ROLE_RANK_ENV: str(place.rank),
        contract.WORLD_SIZE_ENV: str(place.world_size), contract.ROLE_WORLD_SIZE_ENV: str(place.world_size),
        contract.GROUP_RANK_ENV: str(place.group_rank), contract.GROUP_WORLD_SIZE_ENV: str(place.group_world_size),
        contract.LOCAL_WORLD_SIZE_ENV: str(place.local_world_size),
    }
    if place.round >= 0:
        env[contract.ROUND_ENV] = str(place.round)
    return env


def _text(environ: Mapping[str, str], name: str) -> str | None:
    return environ.get(name) or None  # unset or empty: not given


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, "") or default)
    except ValueError:
        return default


def _float(environ: Mapping[str, str], name: str) -> float | None:
    try:
        return float(environ.get(name, ""))
    except ValueError:
        return None


@dataclass(frozen=True)
class NodeEnv:
    """What every worker of one node gets from its agent, the warm standbys included
    (they import prometheus_client before they know their rank, so its directory must be
    set). None: not given (a worker under plain torchrun, or the feature is off)."""

    node_name: str | None = None
    heartbeat_dir: str | None = None
    metrics_dir: str | None = None
    agent_pid: int | None = None
    snapshot_dir: str | None = None  # also a user's, under plain torchrun
    term_grace: float | None = None
    control_dir: str | None = None  # only when the agent runs workers in place
    goodput_dir: str | None = None  # only when goodput accounting is on
    memory_dir: str | None = None  # the node's shared memory for the workers' own copies (memory_copies)
    extra: Mapping[str, str] = field(default_factory=dict)  # not ours (agent/node/netif.py's *_SOCKET_IFNAME); not parsed

    def to_env(self) -> dict[str, str]:
        env = dict(self.extra)
        env.update(_given({
            contract.NODE_NAME_ENV: self.node_name,
            contract.HEARTBEAT_DIR_ENV: self.heartbeat_dir,
            contract.METRICS_DIR_ENV: self.metrics_dir,
            contract.AGENT_PID_ENV: None if self.agent_pid is None else str(self.agent_pid),
            contract.SNAPSHOT_DIR_ENV: self.snapshot_dir,
            contract.TERM_GRACE_ENV: None if self.term_grace is None else f"{self.term_grace:g}",
            contract.CONTROL_DIR_ENV: self.control_dir,
            contract.GOODPUT_DIR_ENV: self.goodput_dir,
            contract.MEMORY_COPY_DIR_ENV: self.memory_dir,
        }))
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "NodeEnv":
        pid = environ.get(contract.AGENT_PID_ENV, "")
        return cls(node_name=_text(environ, contract.NODE_NAME_ENV),
                   heartbeat_dir=_text(environ, contract.HEARTBEAT_DIR_ENV),
                   metrics_dir=_text(environ, contract.METRICS_DIR_ENV),
                   agent_pid=int(pid) if pid.isdigit() else None,
                   snapshot_dir=_text(environ, contract.SNAPSHOT_DIR_ENV),
                   term_grace=_float(environ, contract.TERM_GRACE_ENV),
                   control_dir=_text(environ, contract.CONTROL_DIR_ENV),
                   goodput_dir=_text(environ, contract.GOODPUT_DIR_ENV),
                   memory_dir=_text(environ, contract.MEMORY_COPY_DIR_ENV))


@dataclass(frozen=True)
class RankEnv:
    """torchrun's variables for one worker, as torchrun sets them, plus ours that vary by
    worker start. Parsed, a missing variable reads as a plain one-process run would: rank
    0 of a world of 1, round -1, no restarts."""

    place: Place
    local_rank: int = 0
    role: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    max_restarts: int | None = None
    run_id: str | None = None
    use_agent_store: bool | None = None
    nccl_async_error_handling: str | None = None
    recovering: bool = False  # started to repair a broken world (goodput counts its start-up as recovery)
    setup_world: bool = False  # started into a set-up world of its own; joins the live one at its first batch

    def to_env(self) -> dict[str, str]:
        p = self.place
        return _given({
            contract.RANK_ENV: str(p.rank), contract.LOCAL_RANK_ENV: str(self.local_rank),
            contract.GROUP_RANK_ENV: str(p.group_rank), contract.ROLE_RANK_ENV: str(p.rank),
            contract.ROLE_NAME_ENV: self.role, contract.LOCAL_WORLD_SIZE_ENV: str(p.local_world_size),
            contract.WORLD_SIZE_ENV: str(p.world_size), contract.GROUP_WORLD_SIZE_ENV: str(p.group_world_size),
            contract.ROLE_WORLD_SIZE_ENV: str(p.world_size), contract.MASTER_ADDR_ENV: self.master_addr,
            contract.MASTER_PORT_ENV: None if self.master_port is None else str(self.master_port),
            contract.RESTART_COUNT_ENV: str(self.restart_count),
            contract.MAX_RESTARTS_ENV: None if self.max_restarts is None else str(self.max_restarts),
            contract.RUN_ID_ENV: self.run_id,
            contract.USE_AGENT_STORE_ENV: None if self.use_agent_store is None else str(self.use_agent_store),
            contract.NCCL_ASYNC_ERROR_HANDLING_ENV: self.nccl_async_error_handling,
            contract.ROUND_ENV: str(p.round),
            contract.GOODPUT_RECOVERY_ENV: "1" if self.recovering else None,
            contract.SETUP_WORLD_ENV: "1" if self.setup_world else None,
        })

    def in_setup_world(self, started: Sequence[int], port: int, host: str = "127.0.0.1") -> "RankEnv":
        """This worker in a set-up world of the local ranks ``started`` together (a joiner's
        world before its first step): ranks in local-rank order, its store on ``host:port``."""
        ranks = sorted(started)
        place = Place(rank=ranks.index(self.local_rank), world_size=len(ranks), group_rank=0, group_world_size=1,
                      local_world_size=len(ranks), round=self.place.round)
        return replace(self, place=place, master_addr=host, master_port=port, setup_world=True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "RankEnv":
        place = Place(rank=_int(environ, contract.RANK_ENV, 0), world_size=_int(environ, contract.WORLD_SIZE_ENV, 1),
                      group_rank=_int(environ, contract.GROUP_RANK_ENV, 0),
                      group_world_size=_int(environ, contract.GROUP_WORLD_SIZE_ENV, 0),
                      local_world_size=_int(environ, contract.LOCAL_WORLD_SIZE_ENV, 0),
                      round=_int(environ, contract.ROUND_ENV, -1))
        port, restarts = environ.get(contract.MASTER_PORT_ENV, ""), environ.get(contract.MAX_RESTARTS_ENV, "")
        agent_store = environ.get(contract.USE_AGENT_STORE_ENV)
        return cls(place=place, local_rank=_int(environ, contract.LOCAL_RANK_ENV, 0),
                   role=_text(environ, contract.ROLE_NAME_ENV), master_addr=_text(environ, contract.MASTER_ADDR_ENV),
                   master_port=int(port) if port.isdigit() else None,
                   restart_count=_int(environ, contract.RESTART_COUNT_ENV, 0),
                   max_restarts=int(restarts) if restarts.isdigit() else None,
                   run_id=_text(environ, contract.RUN_ID_ENV),
                   use_agent_store=None if agent_store is None else agent_store == "True",
                   nccl_async_error_handling=_text(environ, contract.NCCL_ASYNC_ERROR_HANDLING_ENV),
                   recovering=environ.get(contract.GOODPUT_RECOVERY_ENV) == "1",
                   setup_world=environ.get(contract.SETUP_WORLD_ENV) == "1")


@dataclass(frozen=True)
class WorkerEnv:
    """A worker's whole environment from the contract: its node's part and its own.

    The agent builds it (``rank`` None: a standby's, which learns its rank later) and
    :meth:`to_env` writes it; a worker reads it with :func:`read` (:meth:`from_env`), which
    always gives a ``rank`` (plain torchrun's defaults where a variable is missing).
    ``started_at`` and ``error_file`` are written in the worker (``agent.worker.warm_worker``) and
    by torch's log specs (``agent.node.workers``), not by this builder."""

    node: NodeEnv = field(default_factory=NodeEnv)
    rank: RankEnv | None = None
    started_at: float | None = None  # when the agent gave a warm standby its rank (its start, for metrics)
    error_file: str | None = None  # torch's error file, where the worker writes why it failed

    def to_env(self) -> dict[str, str]:
        env = self.node.to_env()
        if self.rank is not None:
            env.update(self.rank.to_env())
        env.update(_given({contract.WORKER_STARTED_AT_ENV: None if self.started_at is None else repr(self.started_at),
                           contract.ERROR_FILE_ENV: self.error_file}))
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "WorkerEnv":
        return cls(node=NodeEnv.from_env(environ), rank=RankEnv.from_env(environ),
                   started_at=_float(environ, contract.WORKER_STARTED_AT_ENV),
                   error_file=_text(environ, contract.ERROR_FILE_ENV))

    @property
    def me(self) -> RankEnv:
        """The worker's own part (parsed, it is always there)."""
        assert self.rank is not None, "a standby's environment has no rank yet"
        return self.rank


def read(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """This worker's environment (this process's by default), parsed now: an in-place worker's
    rank variables change at each re-formation (:func:`update_env`), so read it where used."""
    return WorkerEnv.from_env(os.environ if environ is None else environ)


def _given(env: Mapping[str, str | None]) -> dict[str, str]:
    return {k: v for k, v in env.items() if v is not None}


def joins_live_world(peers_in_place: Mapping[str, bool], node: str) -> bool:
    """Whether workers this node starts now join a world that already trains in place: some
    other member of the round runs in-place workers that hold state (their agent says so in
    its registry record). At a job's first start nobody does, and the whole world forms at
    once, set-up included."""
    return any(flag for name, flag in peers_in_place.items() if name != node)


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher (torchrun, ``elastic agent``) placed this process in a world."""
    return contract.RANK_ENV in (os.environ if environ is None else environ)


def be_world_of_one(port: int, environ: MutableMapping[str, str] | None = None) -> None:
    """A script run without a launcher: rank 0 of a world of one, its store on this host
    (``port``, unless the user named one)."""
    environ = os.environ if environ is None else environ
    environ.setdefault(contract.MASTER_ADDR_ENV, "127.0.0.1")
    environ.setdefault(contract.MASTER_PORT_ENV, str(port))
    environ.update({contract.RANK_ENV: "0", contract.WORLD_SIZE_ENV: "1", contract.LOCAL_RANK_ENV: "0"})


def in_setup_world(environ: Mapping[str, str] | None = None) -> bool:
    return read(environ).me.setup_world


def update_env(place: Place, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Write ``place`` into the environment (this process's by default); returns what changed."""
    environ = os.environ if environ is None else environ
    changed = {k: v for k, v in rank_env(place).items() if environ.get(k) != v}
    environ.update(changed)
    environ.pop(contract.SETUP_WORLD_ENV, None)  # the real world now: its own variables from here on
    return changed


__all__ = ["NodeEnv", "Place", "RankEnv", "WorkerEnv", "be_world_of_one", "in_setup_world", "joins_live_world",
           "rank_env", "read", "under_torchrun", "update_env"]

"""The agent/worker contract: everything two processes must agree on, in one place.

``elastic agent`` (the ``agent`` package) and its workers (the ``elastic`` package, plus
the boot code in ``agent.worker.worker_boot`` and ``agent.worker.warm_worker`` that runs *inside* the
worker process) are different processes, often of different builds during an upgrade.
What one writes and the other reads is stated here, and both sides import it, so a
rename cannot reach one side only. It has three parts:

1. **Environment** (:data:`AGENT_TO_WORKER`): the agent sets these in every worker's
   environment when it starts it; the worker reads them. A worker under plain torchrun
   finds none of them and must still run (each reader has a default: no heartbeat, no
   in-place channel, round -1...). torchrun's own variables (``RANK``, ``LOCAL_RANK``,
   ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, ``TORCHELASTIC_*``) are set too, exactly as
   torchrun sets them: that is torch's contract, not ours, but their names are spelled here
   (:data:`TORCHRUN`) so that the ranks are spelled once. :class:`elastic.worker_env.WorkerEnv`
   builds the whole environment on the agent's side and parses it on the worker's, so each
   variable has one writer and one reader. ``docs/agent.md`` ("The agent/worker contract")
   shows :func:`markdown_table`, and a test keeps the two equal.
2. **Files** in node-local directories the agent creates and names through the
   environment above; which side writes each is said beside its name. Every file is
   written whole and renamed into place (or, for heartbeats, one fixed-size ``pwrite``),
   so either side survives the other dying mid-write.
3. **Exit codes** a worker ends with, as the agent's restart policy (``agent.node.policy``)
   reads them, and the **states** a worker reports on the in-place channel
   (:class:`WorkerMode`, :class:`WorkerState`: ``str`` enums, so the JSON stays the same).

:data:`SETTINGS` lists the other ``ELASTIC_*`` variables: knobs a person sets for one
side (or for both, by inheritance), which no process sets for another. They live here
too, in their own section, so that every ``ELASTIC_*`` name in the code is declared
once, in this module (``tests/elastic/test_contract.py`` checks it), and a knob that
starts to cross the boundary is moved to part 1 on purpose rather than by accident.
:data:`AGENT_FLAG_TWINS` declares the ``ELASTIC_<FLAG>`` twin of every ``elastic agent``
flag (a test checks it against the agent's parser, both ways).

This module imports only `dataclasses` and `enum` and must stay that light: the agent, the
worker's first boot line and torchrun's handler loading all import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Crossing:
    """One environment variable the agent hands its workers."""

    name: str
    set_by: str
    read_by: str
    meaning: str


AGENT_TO_WORKER: dict[str, Crossing] = {}
TORCHRUN: dict[str, str] = {}  # torch's names the agent sets as torchrun does -> what each says
SETTINGS: dict[str, str] = {}  # name -> what a person sets it for
AGENT_FLAG_TWINS: dict[str, str] = {}  # ELASTIC_FOO_BAR -> the agent flag's dest (foo_bar) it defaults


def _crossing(name: str, set_by: str, read_by: str, meaning: str) -> str:
    AGENT_TO_WORKER[name] = Crossing(name, set_by, read_by, meaning)
    return name


def _setting(name: str, meaning: str) -> str:
    SETTINGS[name] = meaning
    return name


def _torchrun(name: str, meaning: str) -> str:
    TORCHRUN[name] = meaning
    return name


# ---------------------------------------------------------------------------------------
# 1. Environment: the agent sets, the worker reads.
# ---------------------------------------------------------------------------------------

NODE_NAME_ENV = _crossing(  # the agent's own node name; `elastic local` sets it for its agents too
    "ELASTIC_NODE_NAME", "agent", "log lines, metric labels, `elastic.distributed`",
    "this node's name, as the rendezvous knows it")
ROUND_ENV = _crossing(  # an in-place worker rewrites it at each re-formation (`elastic.worker_env`)
    "ELASTIC_ROUND", "agent", "`ElasticRun`, the snapshot ledger", "the rendezvous round the worker started in")
HEARTBEAT_DIR_ENV = _crossing(  # see HEARTBEAT_FILE below
    "ELASTIC_HEARTBEAT_DIR", "agent", "`elastic.heartbeat`, `elastic.progress`",
    "where each local rank writes its progress beacon for the hang watchdog")
METRICS_DIR_ENV = _crossing(  # prometheus_client's own name: it reads it at import
    "PROMETHEUS_MULTIPROC_DIR", "agent", "prometheus_client, `elastic.metrics`",
    "the multiprocess directory the agent's `/metrics` exports the workers' metrics from")
AGENT_PID_ENV = _crossing(  # a worker whose parent is not this pid at boot exits at once
    "ELASTIC_AGENT_PID", "agent", "`agent.worker.worker_boot` (in the worker)",
    "the agent's pid: the worker arms PR_SET_PDEATHSIG, so it dies with its agent")
SNAPSHOT_DIR_ENV = _crossing(  # set only with --snapshot-dir; a user may set it under plain torchrun
    "ELASTIC_SNAPSHOT_DIR", "agent (`--snapshot-dir`) or the user", "`ElasticRun`, `Elastic`, `elastic.train`",
    "the shared snapshot directory, when the script names none")
TERM_GRACE_ENV = _crossing(  # ElasticRun stops at a step boundary within it
    "ELASTIC_TERM_GRACE", "agent (`--term-grace`)", "`ElasticRun`",
    "seconds from the agent's SIGTERM to its SIGKILL")
CONTROL_DIR_ENV = _crossing(  # set only when the agent runs workers in place; see OFFER_FILE below
    "ELASTIC_CONTROL_DIR", "agent (in place)", "`elastic.inplace.channel`",
    "the in-place channel's directory: round offers in, worker status out")
GOODPUT_DIR_ENV = _crossing(  # set only when goodput accounting is on; see GOODPUT_JOB_FILE below
    "ELASTIC_GOODPUT_DIR", "agent", "`elastic.goodput`", "where workers hand in their goodput intervals")
MEMORY_COPY_DIR_ENV = _crossing(  # the agent's, in shared memory; a user may set one under plain torchrun
    "ELASTIC_MEMORY_COPY_DIR", "agent, or the user", "`elastic.inplace.memory_copies`",
    "where each local rank keeps its own peer copy, for a restarted worker to load")
GOODPUT_RECOVERY_ENV = _crossing(  # "1" or unset
    "ELASTIC_GOODPUT_RECOVERY", "agent", "`elastic.goodput`",
    "`1`: this worker was started to repair a broken world (its start-up is recovery time)")
SETUP_WORLD_ENV = _crossing(  # "1" or unset; the worker drops it once it joins the real world
    "ELASTIC_SETUP_WORLD", "agent (`elastic.worker_env.RankEnv`)", "`ElasticRun`",
    "`1`: the worker joins a live world at its first batch; its start-up world is a private one")
STANDBY_READY_FD_ENV = _crossing(  # popped by the standby once used
    "ELASTIC_STANDBY_READY_FD", "agent (`agent.node.warm_start`)", "`agent.worker.warm_worker` (in the standby)",
    "a pipe the warm standby writes one byte to once its imports are done")
TEMPLATE_REPLY_FD_ENV = _crossing(  # popped by the template at its start
    "ELASTIC_TEMPLATE_REPLY_FD", "agent (`agent.node.fork_server`)", "`agent.worker.fork_template` (in the template)",
    "a pipe on which the node's template reports its readiness, each worker it forks and each exit")
WORKER_STARTED_AT_ENV = _crossing(  # a standby starts long before it becomes a worker
    "ELASTIC_WORKER_STARTED_AT", "`agent.worker.warm_worker` (in the worker)", "`elastic.metrics`",
    "when the agent handed the standby its rank: the worker's start, for its start-up time")
HMAC_KEY_FILE_ENV = _crossing(  # also a setting (the rendezvous reads it); checkpoints/ keeps its own copy
    "ELASTIC_RDZV_HMAC_KEY_FILE", "the user, or agent (`--rdzv-conf hmac_key_file`)",
    "the rendezvous, `checkpoints.signing`", "the job key file; workers sign snapshot manifests with it")


# torchrun's own variables: the agent sets them exactly as torchrun would (torch's names,
# spelled here once; elastic.worker_env.WorkerEnv builds and parses them).
RANK_ENV = _torchrun("RANK", "the worker's global rank")
LOCAL_RANK_ENV = _torchrun("LOCAL_RANK", "the worker's rank on its node (never changes in place)")
GROUP_RANK_ENV = _torchrun("GROUP_RANK", "the node's index in the round")
ROLE_RANK_ENV = _torchrun("ROLE_RANK", "the rank among workers of its role (= RANK: one role)")
ROLE_NAME_ENV = _torchrun("ROLE_NAME", "the worker group's role")
LOCAL_WORLD_SIZE_ENV = _torchrun("LOCAL_WORLD_SIZE", "workers on this node")
WORLD_SIZE_ENV = _torchrun("WORLD_SIZE", "workers in the world")
GROUP_WORLD_SIZE_ENV = _torchrun("GROUP_WORLD_SIZE", "nodes in the round")
ROLE_WORLD_SIZE_ENV = _torchrun("ROLE_WORLD_SIZE", "workers of its role (= WORLD_SIZE)")
MASTER_ADDR_ENV = _torchrun("MASTER_ADDR", "the host of the start-up world's store")
MASTER_PORT_ENV = _torchrun("MASTER_PORT", "the port of the start-up world's store")
RESTART_COUNT_ENV = _torchrun("TORCHELASTIC_RESTART_COUNT", "how often this node's group was restarted")
MAX_RESTARTS_ENV = _torchrun("TORCHELASTIC_MAX_RESTARTS", "the agent's --max-restarts")
RUN_ID_ENV = _torchrun("TORCHELASTIC_RUN_ID", "the job's run id (--rdzv-id)")
USE_AGENT_STORE_ENV = _torchrun("TORCHELASTIC_USE_AGENT_STORE", "whether the worker reuses the agent's store")
ERROR_FILE_ENV = _torchrun("TORCHELASTIC_ERROR_FILE", "where the worker writes its error (torch's logs specs)")
NCCL_ASYNC_ERROR_HANDLING_ENV = _torchrun("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                          "NCCL's async error handling: the agent's own value, else 1")


# ---------------------------------------------------------------------------------------
# 2. Files, in the directories named above. "{local_rank}" is the worker's LOCAL_RANK.
# ---------------------------------------------------------------------------------------

# $ELASTIC_CONTROL_DIR (elastic.inplace.channel):
OFFER_FILE = "round.json"  # agent writes the round to reconfigure into; workers poll it
WORKER_STATUS_FILE = "worker-{local_rank}.json"  # each worker writes its pid, mode, round, re-form request
WAKE_FIFO = "wake"  # a FIFO: a worker writes one byte after a request, the agent waits on it
WHOLE_NODE_KEY = "whole_node"  # in a worker status's extra: start this node's ranks again together (HSDP)
NODE_VERDICT_FILE = "verdict-{local_rank}"  # HSDP: each worker's outcome of its last steps, for its node's others

# $TORCHELASTIC_ERROR_FILE (torch's own format, ``{"message": {"message": ..., "extraInfo": {...}}}``): the
# worker (agent.worker.worker_boot, elastic.failure_record) writes it as it fails, with one key of ours in
# "extraInfo", FAILURE_KIND_KEY: the FailureKind (part 3) of the error, classified where it was caught; the
# agent (agent.node.workers) reads it. A file without the key (an older worker) is a failure of the script's own.
FAILURE_KIND_KEY = "elastic_failure_kind"
# ... and FAULT_CAUSE_KEY: the FaultCause of the error (a full disk, the GPU out of memory...), by its type, if known.
FAULT_CAUSE_KEY = "elastic_fault_cause"

# $ELASTIC_HEARTBEAT_DIR (elastic.heartbeat writes, agent.node.watchdog reads and clears):
HEARTBEAT_PREFIX = "rank-"
HEARTBEAT_FILE = HEARTBEAT_PREFIX + "{local_rank}"  # 56 bytes at offset 0: step, time, pid, kind, loss, samples, finished
STALE_FENCE_FILE = "fence.json"  # rank 0 refused by the fence: the fence's run and round and the snapshot dir (JSON)

# $ELASTIC_GOODPUT_DIR (elastic.goodput.files):
GOODPUT_WORKER_FILE = "worker-{local_rank}.json"  # a worker's intervals not yet in the job's record
GOODPUT_JOB_FILE = "job.json"  # agent writes the job's record as it last saw it in etcd; workers read it

# $ELASTIC_HEARTBEAT_DIR (elastic.consistency.report appends, agent.node.node_agent reads):
SDC_EVENTS_FILE = "sdc-{local_rank}.jsonl"  # one JSON line each time a replica check names this rank
SDC_INJECT_FILE = "sdc-inject-{local_rank}.json"  # agent writes (elastic inject-sdc), the worker takes and removes it
SDC_RESULT_FILE = "sdc-result-{local_rank}.json"  # the worker writes what it did (or why not), the agent takes it to etcd
CHECK_REQUEST_FILE = "check-request-{local_rank}.json"  # agent writes (elastic check), the worker takes it
CHECK_RESULT_FILE = "check-result-{local_rank}.json"  # the worker writes the outcome, the agent takes it to etcd


def worker_status_file(local_rank: int) -> str:
    return WORKER_STATUS_FILE.format(local_rank=local_rank)


def heartbeat_file(local_rank: int) -> str:
    return HEARTBEAT_FILE.format(local_rank=local_rank)


def goodput_worker_file(local_rank: int) -> str:
    return GOODPUT_WORKER_FILE.format(local_rank=local_rank)


def sdc_events_file(local_rank: int) -> str:
    return SDC_EVENTS_FILE.format(local_rank=local_rank)


# ---------------------------------------------------------------------------------------
# 3. Exit codes: the worker exits with them, the agent (agent.node.policy) reads them. A negative
#    code is Popen's view of a worker killed by a signal (a crash, to the agent).
# ---------------------------------------------------------------------------------------

EXIT_OK = 0  # trained its last step; when every local worker did, the agent succeeds
EXIT_FAILED = 1  # an ordinary failure (a traceback, a lost peer): restarted or replaced, counted
USAGE_ERROR_EXIT = 2  # would fail again (bad flags, a snapshot of another model): never restarted; the agent exits 2
FINAL_SNAPSHOT_LOST_EXIT = 74  # trained its last step, but the final snapshot could not be written (a full or
#   read-only snapshot directory; sysexits' EX_IOERR): never restarted, since no restart frees a disk; the agent exits 74
DUPLICATE_HANDLE_EXIT = 75  # a fresh in-place worker whose group handle collided: an ordinary failure, replaced
LEFT_BEHIND_EXIT = 76  # an in-place worker that never left a world its round replaced (elastic.inplace.left_behind):
#   an ordinary failure, restarted in place and healed
SIGNAL_EXIT_BASE = 128  # 128 + signum: ElasticRun stopped for a signal (SIGTERM: 143) at a step boundary


def signal_exit(signum: int) -> int:
    return SIGNAL_EXIT_BASE + int(signum)


class FailureKind(str, Enum):
    """Why a worker's error happened, as the worker classified it where it caught it (by the
    error's type and origin, never its words: elastic.collectives.failure_kind). The agent's
    policy reads it from torchrun's error file (FAILURE_KIND_KEY) to tell a broken world from
    a failure of the node's own."""

    PEER_LOST = "peer_lost"  # a collective broke: a peer died or cut the connection
    TIMEOUT = "timeout"  # a collective or its store waited past its timeout on a silent peer
    ABANDONED = "abandoned"  # the world gave this node's group up (a newer round commits; the run replaced it)
    USER = "user"  # the script's own error (a bug, a bad batch, a RuntimeError of its own whatever it says)

    def __str__(self) -> str:
        return self.value

    @property
    def world_broke(self) -> bool:
        """A peer's doing, not this node's: it never counts towards a crash loop."""
        return self in (FailureKind.PEER_LOST, FailureKind.TIMEOUT)


class FaultCause(str, Enum):
    """What ended a worker, by the error's type (elastic.failure_record.fault_cause), for people:
    the agent's line, ``elastic top``, ``elastic local`` and the goodput timeline name it
    (agent.node.fault_cause). Naming never changes how the agent treats a failure."""

    DISK_FULL = "disk_full"
    GPU_OOM = "cuda_oom"
    NCCL = "nccl_error"
    CUDA = "cuda_error"
    OOM = "oom"  # the host's: a MemoryError, or the OOM killer (the agent's own finding)
    LEASE_LOST = "lease_lost"  # the group was refused by a newer round's fence

    def __str__(self) -> str:
        return self.value


# What a worker reports in its status file ($ELASTIC_CONTROL_DIR/worker-{local_rank}.json):
# str enums, so the JSON on the wire is the plain value an older build reads and writes.

class WorkerMode(str, Enum):
    """How a worker survives a change of membership."""

    IN_PLACE = "in_place"  # reconfigures in its own process (ElasticRun under an in-place agent)
    RESTART = "restart"  # is stopped and started again (a plain script, or in place refused)

    def __str__(self) -> str:
        return self.value


class WorkerState(str, Enum):
    """Where an in-place worker is in its round."""

    STARTING = "starting"  # not yet in a world
    JOINING = "joining"  # forming (or waiting to form) a round's world
    TRAINING = "training"  # in a formed world, taking steps
    REFORMING = "reforming"  # a collective failed: it asked for a new round

    def __str__(self) -> str:
        return self.value


# ---------------------------------------------------------------------------------------
# Settings a person gives, read where they are set (or inherited): not the contract.
# ---------------------------------------------------------------------------------------

ENV_PREFIX = "ELASTIC_"  # agent flags: --foo-bar defaults to $ELASTIC_FOO_BAR (agent.node.launch)
NNODES_ENV = _setting("ELASTIC_NNODES", "the agent's --nnodes, after the flag and before PET_NNODES")
RDZV_ENDPOINT_ENV = _setting("ELASTIC_RDZV_ENDPOINT", "etcd endpoints, for the agent and the tools")
RDZV_ID_ENV = _setting("ELASTIC_RDZV_ID", "the job's run id, for the agent and the tools")
RDZV_CONF_ENV = _setting("ELASTIC_RDZV_CONF", "the rendezvous' key=value options")
LEASE_TTL_ENV = _setting("ELASTIC_LEASE_TTL", "seconds a silent node stays in the registry")
HMAC_KEY_ENV = _setting("ELASTIC_RDZV_HMAC_KEY", "the job key inline (the key file is preferred)")
ETCD_BINARY_ENV = _setting("ELASTIC_ETCD_BINARY", "the etcd binary `elastic etcd` and tests start")
ETCD_PASSWORD_ENV = _setting("ELASTIC_ETCD_PASSWORD", "etcd's password")
ETCD_PASSWORD_FILE_ENV = _setting("ELASTIC_ETCD_PASSWORD_FILE", "a file holding etcd's password")
LOG_LEVEL_ENV = _setting("ELASTIC_LOG_LEVEL", "the `elastic` loggers' level, in agents and workers alike")
METRICS_PORT_ENV = _setting("ELASTIC_METRICS_PORT", "under plain torchrun: each worker serves /metrics on it + LOCAL_RANK")
METRICS_ADDR_ENV = _setting("ELASTIC_METRICS_ADDR", "the address those worker endpoints bind")
COLLECTIVE_METRICS_ENV = _setting("ELASTIC_COLLECTIVE_METRICS", "`0`: no collective timing hook in ElasticRun")
WARM_IMPORTS_ENV = _setting("ELASTIC_WARM_IMPORTS", "the modules a warm standby imports (comma-separated)")
STRAGGLER_PERIOD_ENV = _setting("ELASTIC_STRAGGLER_PERIOD_S", "seconds between the agents' pace records")
STRAGGLER_EVICT_ENV = _setting("ELASTIC_STRAGGLER_EVICT", "`0`: name stragglers, never evict them")
SDC_WINDOW_ENV = _setting("ELASTIC_SDC_WINDOW_S",
                          "seconds within which a node named the outlier twice by replica votes is kept out")
CHECK_EVERY_STEPS_ENV = _setting("ELASTIC_CHECK_EVERY_STEPS",
                                 "steps between ElasticRun's replica consistency checks (0: off)")
SKIP_NONFINITE_ENV = _setting("ELASTIC_SKIP_NONFINITE", "`1`: a batch whose gradients stay non-finite after a "
                                                        "recompute is skipped, not the job's end (docs/reliability.md)")
HEAL_IFNAME_ENV = _setting("ELASTIC_HEAL_IFNAME", "the network interface heals send state over (default: the "
                                                   "collectives' own group; elastic.inplace.heal_link)")
PEER_COPY_EVERY_ENV = _setting("ELASTIC_PEER_COPY_EVERY",
                               "steps between peer copies of each rank's state to a buddy on another node (0: off; "
                               "default: every step for a model sharded across every node, off otherwise)")
FREEZE_PROBE_ENV = _setting("ELASTIC_FREEZE_PROBE", "`0`: no probe of a peer that seems frozen (agent.node.freeze)")
HEALTH_ENV = _setting("ELASTIC_HEALTH", "`off`: no node health checks (agent.node.health)")
HEALTH_MIN_FREE_ENV = _setting("ELASTIC_HEALTH_MIN_FREE_MB", "MiB a node needs free in its snapshot and agent dirs")
HEALTH_MIN_MEM_ENV = _setting("ELASTIC_HEALTH_MIN_MEM_MB", "MiB of MemAvailable a node needs to join")
HEALTH_MAX_SKEW_ENV = _setting("ELASTIC_HEALTH_MAX_SKEW_S", "seconds a node's clock may differ from etcd's")
HEALTH_INTERVAL_ENV = _setting("ELASTIC_HEALTH_INTERVAL_S", "seconds between health looks while a node trains")



# ---------------------------------------------------------------------------------------
# The agent's flags: every `elastic agent --foo-bar` defaults to $ELASTIC_FOO_BAR
# (agent.node.launch). Declared so that each name the agent may read is in this module; a test
# checks this list against the agent's parser both ways. Some are also crossings or
# settings above (--node-name, --snapshot-dir, --term-grace, --nnodes, --rdzv-*, ...).
# ---------------------------------------------------------------------------------------

def flag_twin(dest: str) -> str:
    """The variable that defaults the agent flag whose argparse ``dest`` is ``dest``."""
    return ENV_PREFIX + dest.upper()


def _flags(*dests: str) -> None:
    for dest in dests:
        AGENT_FLAG_TWINS[flag_twin(dest)] = dest


_flags(  # torchrun's flags (torch.distributed.run), which the agent takes as they are
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "standalone",
    "max_restarts", "monitor_interval", "start_method", "role", "module", "no_python", "run_path", "log_dir",
    "redirects", "tee", "local_ranks_filter", "node_rank", "master_addr", "master_port", "local_addr",
    "logs_specs", "log_line_prefix_template", "event_log_handler", "numa_binding", "signals_to_handle",
    "duplicate_stdout_filters", "duplicate_stderr_filters", "virtual_local_rank", "print_completion",
    "shutdown_timeout")
_flags(  # the agent's own (agent.node.launch)
    "node_name", "metrics_port", "metrics_addr", "lease_ttl", "hang_timeout", "snapshot_dir", "warm_start",
    "in_place", "agent_dir", "hang_startup_timeout", "keep_out_s", "term_grace")


def markdown_table() -> str:
    """The table ``docs/agent.md`` shows (``python -m elastic.contract`` prints it)."""
    rows = ["| variable | set by | read by | what it says |", "|---|---|---|---|"]
    rows += [f"| `{c.name}` | {c.set_by} | {c.read_by} | {c.meaning} |" for c in AGENT_TO_WORKER.values()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")

"""The agent/worker contract: everything two processes must agree on, in one place.

``elastic agent`` (the ``agent`` package) and its workers (the ``elastic`` package, plus
the boot code in ``agent.worker_boot`` and ``agent.warm_worker`` that runs *inside* the
worker process) are different processes, often of different builds during an upgrade.
What one writes and the other reads is stated here, and both sides import it, so a
rename cannot reach one side only. It has three parts:

1. **Environment** (:data:`AGENT_TO_WORKER`): the agent sets these in every worker's
   environment when it starts it; the worker reads them. A worker under plain torchrun
   finds none of them and must still run (each reader has a default: no heartbeat, no
   in-place channel, round -1...). torchrun's own variables (``RANK``, ``LOCAL_RANK``,
   ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, ``TORCHELASTIC_*``) are set too, exactly as
   torchrun sets them: that is torch's contract, not ours, and is not repeated here.
   ``docs/agent.md`` ("The agent/worker contract") shows :func:`markdown_table`, and a test
   keeps the two equal.
2. **Files** in node-local directories the agent creates and names through the
   environment above; which side writes each is said beside its name. Every file is
   written whole and renamed into place (or, for heartbeats, one fixed-size ``pwrite``),
   so either side survives the other dying mid-write.
3. **Exit codes** a worker ends with, as the agent's restart policy (``agent.policy``)
   reads them.

:data:`SETTINGS` lists the other ``ELASTIC_*`` variables: knobs a person sets for one
side (or for both, by inheritance), which no process sets for another. They live here
too, in their own section, so that every ``ELASTIC_*`` name in the code is declared
once, in this module (``tests/elastic/test_contract.py`` checks it), and a knob that
starts to cross the boundary is moved to part 1 on purpose rather than by accident.

This module imports only `dataclasses` and must stay that light: the agent, the worker's first
boot line and torchrun's handler loading all import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Crossing:
    """One environment variable the agent hands its workers."""

    name: str
    set_by: str
    read_by: str
    meaning: str


AGENT_TO_WORKER: dict[str, Crossing] = {}
SETTINGS: dict[str, str] = {}  # name -> what a person sets it for


def _crossing(name: str, set_by: str, read_by: str, meaning: str) -> str:
    AGENT_TO_WORKER[name] = Crossing(name, set_by, read_by, meaning)
    return name


def _setting(name: str, meaning: str) -> str:
    SETTINGS[name] = meaning
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
    "ELASTIC_AGENT_PID", "agent", "`agent.worker_boot` (in the worker)",
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
GOODPUT_RECOVERY_ENV = _crossing(  # "1" or unset
    "ELASTIC_GOODPUT_RECOVERY", "agent", "`elastic.goodput`",
    "`1`: this worker was started to repair a broken world (its start-up is recovery time)")
SETUP_WORLD_ENV = _crossing(  # "1" or unset; the worker drops it once it joins the real world
    "ELASTIC_SETUP_WORLD", "agent (`elastic.worker_env.setup_world_env`)", "`ElasticRun`",
    "`1`: the worker joins a live world at its first batch; its start-up world is a private one")
STANDBY_READY_FD_ENV = _crossing(  # popped by the standby once used
    "ELASTIC_STANDBY_READY_FD", "agent (`agent.warm_start`)", "`agent.warm_worker` (in the standby)",
    "a pipe the warm standby writes one byte to once its imports are done")
TEMPLATE_REPLY_FD_ENV = _crossing(  # popped by the template at its start
    "ELASTIC_TEMPLATE_REPLY_FD", "agent (`agent.fork_server`)", "`agent.fork_template` (in the template)",
    "a pipe on which the node's template reports its readiness, each worker it forks and each exit")
WORKER_STARTED_AT_ENV = _crossing(  # a standby starts long before it becomes a worker
    "ELASTIC_WORKER_STARTED_AT", "`agent.warm_worker` (in the worker)", "`elastic.metrics`",
    "when the agent handed the standby its rank: the worker's start, for its start-up time")
HMAC_KEY_FILE_ENV = _crossing(  # also a setting (the rendezvous reads it); checkpoints/ keeps its own copy
    "ELASTIC_RDZV_HMAC_KEY_FILE", "the user, or agent (`--rdzv-conf hmac_key_file`)",
    "the rendezvous, `checkpoints.signing`", "the job key file; workers sign snapshot manifests with it")


# ---------------------------------------------------------------------------------------
# 2. Files, in the directories named above. "{local_rank}" is the worker's LOCAL_RANK.
# ---------------------------------------------------------------------------------------

# $ELASTIC_CONTROL_DIR (elastic.inplace.channel):
OFFER_FILE = "round.json"  # agent writes the round to reconfigure into; workers poll it
WORKER_STATUS_FILE = "worker-{local_rank}.json"  # each worker writes its pid, mode, round, re-form request
WAKE_FIFO = "wake"  # a FIFO: a worker writes one byte after a request, the agent waits on it

# $ELASTIC_HEARTBEAT_DIR (elastic.heartbeat writes, agent.watchdog reads and clears):
HEARTBEAT_PREFIX = "rank-"
HEARTBEAT_FILE = HEARTBEAT_PREFIX + "{local_rank}"  # 56 bytes at offset 0: step, time, pid, kind, loss, samples, finished
STALE_FENCE_FILE = "fence.json"  # rank 0 refused by the fence: the fence's run and round and the snapshot dir (JSON)

# $ELASTIC_GOODPUT_DIR (elastic.goodput.files):
GOODPUT_WORKER_FILE = "worker-{local_rank}.json"  # a worker's intervals not yet in the job's record
GOODPUT_JOB_FILE = "job.json"  # agent writes the job's record as it last saw it in etcd; workers read it

# $ELASTIC_HEARTBEAT_DIR (elastic.consistency.report appends, agent.node_agent reads):
SDC_EVENTS_FILE = "sdc-{local_rank}.jsonl"  # one JSON line each time a replica check names this rank
SDC_INJECT_FILE = "sdc-inject-{local_rank}.json"  # agent writes (elastic inject-sdc), the worker takes and removes it


def worker_status_file(local_rank: int) -> str:
    return WORKER_STATUS_FILE.format(local_rank=local_rank)


def heartbeat_file(local_rank: int) -> str:
    return HEARTBEAT_FILE.format(local_rank=local_rank)


def goodput_worker_file(local_rank: int) -> str:
    return GOODPUT_WORKER_FILE.format(local_rank=local_rank)


def sdc_events_file(local_rank: int) -> str:
    return SDC_EVENTS_FILE.format(local_rank=local_rank)


# ---------------------------------------------------------------------------------------
# 3. Exit codes: the worker exits with them, the agent (agent.policy) reads them. A negative
#    code is Popen's view of a worker killed by a signal (a crash, to the agent).
# ---------------------------------------------------------------------------------------

EXIT_OK = 0  # trained its last step; when every local worker did, the agent succeeds
EXIT_FAILED = 1  # an ordinary failure (a traceback, a lost peer): restarted or replaced, counted
USAGE_ERROR_EXIT = 2  # would fail again (bad flags, a snapshot of another model): never restarted; the agent exits 2
FINAL_SNAPSHOT_LOST_EXIT = 74  # trained its last step, but the final snapshot could not be written (a full or
#   read-only snapshot directory; sysexits' EX_IOERR): never restarted, since no restart frees a disk; the agent exits 74
DUPLICATE_HANDLE_EXIT = 75  # a fresh in-place worker whose group handle collided: an ordinary failure, replaced
SIGNAL_EXIT_BASE = 128  # 128 + signum: ElasticRun stopped for a signal (SIGTERM: 143) at a step boundary


def signal_exit(signum: int) -> int:
    return SIGNAL_EXIT_BASE + int(signum)


# ---------------------------------------------------------------------------------------
# Settings a person gives, read where they are set (or inherited): not the contract.
# ---------------------------------------------------------------------------------------

ENV_PREFIX = "ELASTIC_"  # agent flags: --foo-bar defaults to $ELASTIC_FOO_BAR (agent.launch)
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
FREEZE_PROBE_ENV = _setting("ELASTIC_FREEZE_PROBE", "`0`: no probe of a peer that seems frozen (agent.freeze)")
HEALTH_ENV = _setting("ELASTIC_HEALTH", "`off`: no node health checks (agent.health)")
HEALTH_MIN_FREE_ENV = _setting("ELASTIC_HEALTH_MIN_FREE_MB", "MiB a node needs free in its snapshot and agent dirs")
HEALTH_MIN_MEM_ENV = _setting("ELASTIC_HEALTH_MIN_MEM_MB", "MiB of MemAvailable a node needs to join")
HEALTH_MAX_SKEW_ENV = _setting("ELASTIC_HEALTH_MAX_SKEW_S", "seconds a node's clock may differ from etcd's")
HEALTH_INTERVAL_ENV = _setting("ELASTIC_HEALTH_INTERVAL_S", "seconds between health looks while a node trains")


def markdown_table() -> str:
    """The table ``docs/agent.md`` shows (``python -m elastic.contract`` prints it)."""
    rows = ["| variable | set by | read by | what it says |", "|---|---|---|---|"]
    rows += [f"| `{c.name}` | {c.set_by} | {c.read_by} | {c.meaning} |" for c in AGENT_TO_WORKER.values()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")

"""What ``elastic agent`` adds to torchrun's flags, resolved once at start and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agent.rendezvous.keepout import BACKOFF_BASE_S


@dataclass(frozen=True)
class AgentSettings:
    node_name: str
    metrics_port: int  # 0: no endpoint; -1 (--metrics-port auto): a port the kernel picks
    metrics_addr: str
    lease_ttl: int
    hang_timeout: float | None  # None: derived from the observed step time
    snapshot_dir: Path | str | None  # a directory, or an s3:// URL
    work_dir: Path  # heartbeat/, metrics/, control/ and goodput/ live here
    warm_start: bool = True  # keep pre-imported standby workers (agent/node/warm_start.py)
    in_place: bool = True  # let ElasticRun workers survive membership changes (elastic/inplace)
    graceful_stop: float = 5.0  # SIGTERM -> SIGKILL grace when a healthy world re-forms
    hang_startup_timeout: float = 600.0  # a group's first progress, once the job has shown some
    standby_refill_after: float = 10.0  # a group alive this long without progress counts as up
    exit_barrier_timeout: float = 300.0  # a finished node waits this long for the others
    store_host: str | None = None  # the address peers reach this node's round store at
    worker_env: dict[str, str] = field(default_factory=dict)  # e.g. GLOO_SOCKET_IFNAME (agent/node/netif.py)
    keep_out_s: float = BACKOFF_BASE_S  # --keep-out-s: a first keep-out's back-off (agent.node.keep_outs)
    memory_dir: Path | None = None  # the workers' own copies, in shared memory (agent_dir.claim_memory_dir)

    @property
    def heartbeat_dir(self) -> Path:
        return self.work_dir / "heartbeat"

    @property
    def metrics_dir(self) -> Path:
        return self.work_dir / "metrics"

    @property
    def control_dir(self) -> Path:
        return self.work_dir / "control"

    @property
    def goodput_dir(self) -> Path:
        return self.work_dir / "goodput"

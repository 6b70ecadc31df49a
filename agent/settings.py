"""What ``elastic agent`` adds to torchrun's flags, resolved once at start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AgentSettings:
    node_name: str
    metrics_port: int  # 0: no endpoint
    metrics_addr: str
    lease_ttl: int
    hang_timeout: float | None  # None: derived from the observed step time
    snapshot_dir: Path | None
    heartbeat_dir: Path
    metrics_dir: Path  # the workers' prometheus multiprocess files
    warm_start: bool = True  # keep pre-imported standby workers (agent/warm_start.py)
    graceful_stop: float = 5.0  # SIGTERM -> SIGKILL grace when a healthy world re-forms

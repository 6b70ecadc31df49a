"""One local "node": a real torchrun agent and its workers, as one process tree.

The one-machine demo and the tests use it to stand for a machine: it can be killed
(SIGKILL of the whole tree, since torchrun puts workers in their own sessions), frozen
and thawed. Its progress comes from the job's own progress file (``elastic.train
--progress``) when there is one, else from the agent: the heartbeat every worker beats
after each optimizer step and the agent's ``status.json`` (round and ranks), so any script
can be followed without a change. Rows built that way carry ``kind``: ``job`` when the
script reported its own step numbers (``elastic.report_progress(step)``), ``count`` when
they only count this process's optimizer steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .proctree import freeze_tree, kill_tree, process_tree, thaw_tree

if TYPE_CHECKING:
    from .netns import Namespace

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ELASTIC = [sys.executable, "-m", "agent.cli", "agent"]


@dataclass
class LocalNode:
    """``elastic agent`` (or plain ``torchrun``) running ``module`` as node ``name``.

    ``{progress}`` in ``module_args`` becomes this node's progress file; ``agent_args``
    are extra launcher flags (``--metrics-port``, ``--hang-timeout``...). With ``netns``
    (from :class:`agent.netns.NodeNetwork`) the node runs inside that namespace and uses its
    address for ``--local-addr`` and ``--metrics-addr``, as a node on its own host would.
    """

    name: str
    endpoint: str
    run_id: str
    workdir: Path
    module: str = "elastic.examples.tiny_ddp"
    module_args: Sequence[str] = ()
    script: str | None = None  # run this file instead of ``-m module`` (its args: module_args)
    nnodes: str = "1:3"
    nproc_per_node: int = 1
    max_restarts: int = 20
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    launcher: str = "elastic"  # or "torchrun": torch's own launcher
    rdzv_backend: str = "etcd-v3"  # "c10d" for comparisons (then endpoint is the store host's)
    agent_args: Sequence[str] = ()
    metrics_port: int = 0
    netns: Namespace | None = None  # run inside this network namespace (agent.netns), at its address
    process: subprocess.Popen[bytes] | None = None
    frozen: list[int] = field(default_factory=list)
    _rows: list[dict[str, Any]] = field(default_factory=list, repr=False)
    _read_to: int = field(default=0, repr=False)  # bytes of the progress file already parsed
    _beats_seen: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def metrics_host(self) -> str:
        """Where this node's /metrics listens: its namespace's address, else loopback."""
        return self.netns.addr if self.netns is not None else "127.0.0.1"

    @property
    def progress_path(self) -> Path:
        return self.workdir / f"{self.name}.progress.jsonl"

    @property
    def agent_dir(self) -> Path:
        return self.workdir / f"{self.name}.agent"

    def command(self) -> list[str]:
        cmd = [*ELASTIC, "--node-name", self.name, "--metrics-port", str(self.metrics_port),
               "--agent-dir", str(self.agent_dir)] if self.launcher == "elastic" else [TORCHRUN]
        if self.netns is not None:  # peers and scrapers reach it at its own address, as on a host
            cmd += ["--local-addr", self.netns.addr]
            cmd += ["--metrics-addr", self.netns.addr] if self.launcher == "elastic" else []
        cmd += [
            "--nnodes", self.nnodes,
            "--nproc-per-node", str(self.nproc_per_node),
            "--rdzv-backend", self.rdzv_backend,
            "--rdzv-endpoint", self.endpoint,
            "--rdzv-id", self.run_id,
            "--max-restarts", str(self.max_restarts),
            "--monitor-interval", "0.1",
        ]
        if self.rdzv_conf:
            cmd += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in self.rdzv_conf.items())]
        args = [a.replace("{progress}", str(self.progress_path)) for a in self.module_args]
        target = [self.script] if self.script is not None else ["-m", self.module]
        cmd += [*self.agent_args, *target, *args]
        return self.netns.wrap(cmd) if self.netns is not None else cmd  # `ip netns exec` keeps the pid

    def start(self) -> "LocalNode":
        env = {**os.environ, "ELASTIC_NODE_NAME": self.name, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=self.workdir, start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> list[int]:
        """Node loss: SIGKILL the agent and all its workers at once."""
        pids = kill_tree(self.pid, signal.SIGKILL)
        assert self.process is not None
        self.process.wait(timeout=10)
        return pids

    def freeze(self) -> None:
        self.frozen = freeze_tree(self.pid)

    def thaw(self) -> None:
        thaw_tree(self.frozen)
        self.frozen = []

    def cleanup(self) -> None:
        if self.process is None:
            return
        if self.frozen:
            self.thaw()
        if process_tree(self.pid):
            kill_tree(self.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def progress(self) -> list[dict[str, Any]]:
        """Every progress row so far: the job's progress file, or else the agent's heartbeats."""
        rows = self._file_progress()
        return rows if rows else self._beat_progress()

    def _file_progress(self) -> list[dict[str, Any]]:
        """Every complete progress line so far; only what was appended since the last call
        is read, since the live view and the tests poll this many times a second."""
        try:
            with open(self.progress_path, "rb") as f:
                f.seek(self._read_to)
                fresh = f.read()
        except FileNotFoundError:
            return [r for r in self._rows if r.get("kind") == "file"]
        complete = fresh[: fresh.rfind(b"\n") + 1]  # a line still being written waits for its end
        self._read_to += len(complete)
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by SIGKILL, with the restarted node's next line glued on
            row.setdefault("kind", "file")
            self._rows.append(row)
        return [r for r in self._rows if r.get("kind") == "file"]

    def _beat_progress(self) -> list[dict[str, Any]]:
        """One row per new heartbeat seen (any script): rank and world from the agent's status."""
        from elastic.heartbeat import JOB_STEP, read_beats

        try:
            status = json.loads((self.agent_dir / "status.json").read_text())
        except (OSError, ValueError):
            return [r for r in self._rows if r.get("kind") != "file"]
        for local_rank, beat in sorted(read_beats(self.agent_dir / "heartbeat").items()):
            key = (local_rank, beat.pid)
            if self._beats_seen.get(key) == (beat.step, beat.time) or beat.time < float(status["time"]):
                continue  # seen, or beaten before this round began (not this round's)
            self._beats_seen[key] = (beat.step, beat.time)
            self._rows.append({
                "node": self.name, "rank": int(status["rank_base"]) + local_rank, "local_rank": local_rank,
                "world_size": int(status["world_size"]), "step": beat.step, "time": beat.time,
                "round": int(status["round"]), "pid": beat.pid, "loss": None, "samples": 0,
                "kind": "job" if beat.kind == JOB_STEP else "count",
            })
        return [r for r in self._rows if r.get("kind") != "file"]

    def steps_at(self, world_size: int, after: float = 0.0) -> list[dict[str, Any]]:
        """Steps this node completed in a world of ``world_size`` after time ``after``."""
        return [r for r in self.progress() if r["world_size"] == world_size and r["time"] > after]

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return f"{self.name}: no log"
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"--- {self.name} log (last {lines} lines) ---\n" + "\n".join(text[-lines:])

"""Plain torchrun, no agent: each worker serves its own /metrics on ELASTIC_METRICS_PORT + local rank.

A real ``torchrun --standalone`` run of two gloo CPU workers, scraped over HTTP while it
trains, then stopped the way torchrun stops workers (SIGTERM).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent.node.proctree import kill_tree
from elastic.jobs.mlp import make_model
from elastic.metrics import families
from tests.elastic.metrics.scrape import Series, fetch, names, value
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
GLOBAL_BATCH = 16  # 8 samples per rank at world 2


def free_port_pair() -> int:
    """A port BASE with BASE + 1 free too (both bound once, then released)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = int(a.getsockname()[1])
            if base + 1 > 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
        return base
    raise AssertionError("no two adjacent free ports on 127.0.0.1")


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    base = free_port_pair()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PROMETHEUS_MULTIPROC_DIR", "ELASTIC_HEARTBEAT_DIR")}
    env.update(ELASTIC_METRICS_PORT=str(base), ELASTIC_METRICS_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "elastic.train", "--job", "mlp",
             "--steps", "100000", "--dataset-size", "4096", "--global-batch-size", str(GLOBAL_BATCH),
             "--snapshot-every-steps", "10", "--step-sleep", "0.02", "--backend", "gloo",
             "--snapshot-dir", str(tmp_path / "snap")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        yield proc, base, log
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _log_tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-40:])


@pytest.mark.slow  # starts processes
def test_each_worker_serves_its_rank_on_base_plus_local_rank(run: tuple[subprocess.Popen[bytes], int, Path]) -> None:
    proc, base, log = run
    urls = [f"http://127.0.0.1:{base + r}/metrics" for r in (0, 1)]

    def both_trained_and_snapshotted() -> list[Series] | None:
        assert proc.poll() is None, f"torchrun exited early ({proc.returncode})\n{_log_tail(log)}"
        scrapes = [fetch(u) for u in urls]
        if any(s is None for s in scrapes):
            return None
        s0, s1 = scrapes
        if (value(s0, "elastic_snapshot_bytes_total") or 0) <= 0 or (value(s1, "elastic_steps_total", rank="1") or 0) < 5:
            return None
        return scrapes  # type: ignore[return-value]  # no None in it: checked above

    s0, s1 = wait_until(both_trained_and_snapshotted, 120, "both workers to serve metrics after a snapshot",
                        interval=0.25, on_timeout=lambda: _log_tail(log))

    grad_bytes = sum(p.numel() for p in make_model().parameters()) * 4  # fp32
    for rank, s in ((0, s0), (1, s1)):
        r = str(rank)
        steps = value(s, "elastic_steps_total", rank=r)
        assert steps is not None and steps >= 5, f"rank {rank} steps {steps}"
        other = str(1 - rank)
        assert value(s, "elastic_steps_total", rank=other) is None, "a worker's port shows only its own rank"
        assert value(s, "elastic_rank", rank=r) == rank
        assert value(s, "elastic_world_size") == 2
        assert value(s, "elastic_worker_restarts") == 0
        # A scrape is not atomic: the worker may be one step further in the counters read later.
        samples = value(s, "elastic_samples_total", rank=r)
        assert samples is not None and steps - 1 <= samples / (GLOBAL_BATCH // 2) <= steps + 1
        labels = {"op": "allreduce", "backend": "gloo"}
        nbytes = value(s, "elastic_collective_bytes_total", **labels)
        assert nbytes is not None and nbytes % grad_bytes == 0, f"{nbytes} is not a multiple of {grad_bytes}"
        assert steps <= nbytes / grad_bytes <= steps + 2, f"rank {rank}: {nbytes / grad_bytes} all-reduces, {steps} steps"
        assert (value(s, "elastic_collective_duration_seconds_count", **labels) or 0) >= steps
        assert value(s, "elastic_collective_errors_total", **labels) == 0
        assert (value(s, "elastic_step_duration_seconds_count", rank=r) or 0) >= steps
        assert (value(s, "elastic_data_wait_seconds_count", rank=r) or 0) >= steps
        assert abs(time.time() - (value(s, "elastic_last_step_timestamp_seconds", rank=r) or 0)) < 60
        loss = value(s, "elastic_loss", rank=r)
        assert loss is not None and math.isfinite(loss) and loss > 0
        assert 0 < (value(s, "elastic_time_to_first_step_seconds") or 0) < 120
        assert (value(s, "elastic_restore_seconds") or -1) >= 0
        build = [labels for name, labels in s if name == "elastic_build_info"]
        assert len(build) == 1 and {("backend", "gloo"), ("device", "cpu")} <= set(build[0])

    assert time.time() - (value(s0, "elastic_snapshot_last_durable_timestamp_seconds") or 0) < 60
    assert (value(s0, "elastic_snapshot_write_seconds_count") or 0) >= 1
    # Every metric in the catalogue shows up on some rank, except tokens (the mlp job has none).
    exported = names(s0) | names(s1)
    for metric in families().registry.collect():
        if metric.name != "elastic_tokens":
            assert any(n.startswith(metric.name) for n in exported), f"{metric.name} is not served"

    proc.send_signal(signal.SIGTERM)  # how torchrun is stopped; it stops its workers
    wait_until(lambda: proc.poll() is not None, 60, "torchrun to stop", on_timeout=lambda: _log_tail(log))

"""``elastic local``'s pure decisions: each worker's share of the machine's cores."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from agent.local_cluster import _job, _nodes, parse_args, threads_per_worker


@pytest.mark.parametrize(("workers", "cores", "threads"), [
    (3, 2, 1),    # the demo on a 2-core machine: one each, not two spinning against each other
    (3, 16, 5),   # what is left over stays idle rather than oversubscribed
    (2, 16, 8),
    (1, 8, 8),    # one worker: torch's own default
    (4, None, 1),  # os.cpu_count() may not know
])
def test_each_worker_gets_its_share_of_the_cores(workers: int, cores: int | None, threads: int) -> None:
    assert threads_per_worker(workers, cores) == threads


def test_every_node_hands_its_workers_that_share_unless_the_user_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, job_args = parse_args(["--nodes", "3", "--nproc-per-node", "2", "--run-dir", str(tmp_path)])
    job, _ = _job(args, job_args, tmp_path)
    etcd = types.SimpleNamespace(endpoint="127.0.0.1:2379")  # only its address is read; nothing starts here
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    nodes = _nodes(args, job, tmp_path, etcd, None, tmp_path / "key")  # type: ignore[arg-type]
    assert [n.node.env["OMP_NUM_THREADS"] for n in nodes] == ["2", "2", "2"]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    nodes = _nodes(args, job, tmp_path, etcd, None, tmp_path / "key")  # type: ignore[arg-type]
    assert all("OMP_NUM_THREADS" not in n.node.env for n in nodes)  # the user's own reaches the workers as is

"""``ELASTIC_COLLECTIVE_METRICS=0`` leaves DDP without our comm hook (a real world of one)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic.distributed import DistInfo
from elastic.metrics.training import TrainingMetrics, collective_metrics_enabled


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False), ("off", False),
                                                 ("false", False)])
def test_the_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch, value: str | None, enabled: bool) -> None:
    if value is None:
        monkeypatch.delenv("ELASTIC_COLLECTIVE_METRICS", raising=False)
    else:
        monkeypatch.setenv("ELASTIC_COLLECTIVE_METRICS", value)
    assert collective_metrics_enabled() is enabled


def hook_name(model: DistributedDataParallel) -> str:
    """What DDP logged at registration. No backward: that would add to this process's
    collective counters, which other tests in the session read."""
    return str(model._get_ddp_logging_data().get("comm_hook", ""))


@pytest.mark.parametrize(("value", "hooked"), [("1", True), ("0", False)])
def test_ddp_gets_the_timing_hook_only_when_switched_on(world_of_one: None, monkeypatch: pytest.MonkeyPatch,
                                                        value: str, hooked: bool) -> None:
    for name in ("PROMETHEUS_MULTIPROC_DIR", "ELASTIC_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)  # in-process metrics, no port
    monkeypatch.setenv("ELASTIC_COLLECTIVE_METRICS", value)
    metrics = TrainingMetrics(DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                                       backend="gloo", node="n"))
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    assert metrics.attach(model) is True, "attach() must average unless asked not to: a user's loss has no 1/world"
    assert (metrics.collectives is not None) is hooked
    assert metrics.collectives is None or metrics.collectives.average
    assert ("allreduce_hook" in hook_name(model)) is hooked

"""Where the run trains: its own choice (a GPU when there is one) unless told, and the
prepare API tells it the device the script put the model on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elastic
from elastic.distributed import DistInfo, ElasticRunError
from elastic.trainer import ElasticRun

RUN = {"metrics": False, "snapshots": elastic.SnapshotConfig(writer="thread"), "handle_sigterm": False}


def _bare_run(device: str | None) -> ElasticRun:
    """Only the device policy of a run (its setter of ``dist``): no group, no GPU needed."""
    run = object.__new__(ElasticRun)
    run._device = torch.device(device) if device is not None else None
    return run


def _world(device: str, backend: str) -> DistInfo:
    # A GPU world as init_distributed reports it on a GPU node; this machine has no GPU,
    # so the info is written out rather than measured.
    return DistInfo(0, 2, 0, torch.device(device), backend, "node-a")


def test_a_model_on_the_cpu_trains_on_the_cpu_on_a_gpu_node_with_gloo() -> None:
    run = _bare_run("cpu")
    run.dist = _world("cuda:0", "gloo")
    assert run.dist.device == torch.device("cpu")
    assert (run.dist.rank, run.dist.world_size, run.dist.backend) == (0, 2, "gloo")


def test_without_a_device_the_run_keeps_the_worlds_choice() -> None:
    run = _bare_run(None)
    run.dist = _world("cuda:0", "gloo")
    assert run.dist.device == torch.device("cuda:0")


def test_a_model_on_the_cpu_with_nccl_is_one_line_saying_how_to_fix_it() -> None:
    run = _bare_run("cpu")
    with pytest.raises(ElasticRunError, match=r"model is on cpu but the backend is nccl.*model.to\(local_rank\)"):
        run.dist = _world("cuda:0", "nccl")


def test_prepare_passes_the_device_the_script_put_the_model_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    ft = elastic.Elastic(snapshot_dir=tmp_path, **RUN)
    ft.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4))
    try:
        assert ft.run._device == torch.device("cpu")
        assert ft.run.dist.device == torch.device("cpu")
    finally:
        ft.run.close()

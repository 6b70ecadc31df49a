"""The all-reduce hook: DDP's gradients to the bit, its bytes and buckets counted, failures counted.

World 3 on purpose: averaging by ``x / 3`` and by ``x * (1/3)`` differ in the last bit, so
a hook that averaged differently from DDP's reducer would fail here (world 2 would hide it).
Processes forked from one forkserver over a FileStore keep this to a few seconds (no torch
import per process on two busy cores); rendezvous is not the point.
"""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as torch_reference_hook
from torch.nn.parallel import DistributedDataParallel

WORLD, STEPS = 3, 2
BUCKET_CAP_MB = 0.01  # ~10 KB buckets: several per step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _grads_after(ddp: DistributedDataParallel, rank: int) -> list[list[torch.Tensor]]:
    """STEPS backward passes on rank-specific data, with an SGD step between them."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        x = torch.randn(5, 32, generator=gen)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        out.append([p.grad.clone() for p in ddp.parameters()])
        opt.step()
    return out


def _series(name: str, **labels: str) -> float:
    from elastic.metrics import families

    value = families().registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _worker(rank: int, tmp: str) -> None:
    from elastic.metrics import register_comm_hook

    torch.set_num_threads(1)
    store = dist.FileStore(f"{tmp}/store", WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
    plain = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    hooked = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    timer = register_comm_hook(hooked, "gloo")
    reference = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    reference.register_comm_hook(None, torch_reference_hook)

    labels = {"op": "allreduce", "backend": "gloo"}
    want = _grads_after(plain, rank)
    got = _grads_after(hooked, rank)
    ref = _grads_after(reference, rank)
    numel = sum(p.numel() for p in hooked.parameters())
    result = {
        "want": want, "got": got, "ref": ref, "numel": numel,
        "bytes": _series("elastic_collective_bytes_total", **labels),
        "count": _series("elastic_collective_duration_seconds_count", **labels),
        "sum": _series("elastic_collective_duration_seconds_sum", **labels),
        "errors_before": _series("elastic_collective_errors_total", **labels),
        "world": timer.world_size,
    }
    summing = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    register_comm_hook(summing, "gloo", average=False)
    result["summed"] = _grads_after(summing, rank)

    # HSDP's all-reduce across replicas, which the run issues itself: counted as the hook's are
    from elastic.metrics.comm_hook import timed_all_reduce

    counted = _series("elastic_collective_duration_seconds_count", **labels)
    sent = _series("elastic_collective_bytes_total", **labels)
    mine = torch.full((5,), float(rank + 1))
    timed_all_reduce(timer, mine, None)
    result["timed"] = mine.tolist()
    result["timed_count"] = _series("elastic_collective_duration_seconds_count", **labels) - counted
    result["timed_bytes"] = _series("elastic_collective_bytes_total", **labels) - sent

    # A peer that is gone makes the next all-reduce fail; the hook counts it on the survivors.
    dist.barrier()
    if rank == WORLD - 1:
        torch.save(result, f"{tmp}/rank{rank}.pt")
        os._exit(0)  # leave without a goodbye, as a crashed node would
    try:
        _grads_after(hooked, rank)
    except Exception as e:  # noqa: BLE001 - the failure is what this part provokes
        result["raised"] = type(e).__name__
    result["errors_after"] = _series("elastic_collective_errors_total", **labels)
    torch.save(result, f"{tmp}/rank{rank}.pt")
    os._exit(0)  # the group is broken; destroying it could wait for the dead peer


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("hook")
    # The ranks fork from a fresh, single-threaded forkserver that imported torch and this module
    # once, not from the pytest worker itself: earlier in-process tests can leave that worker with
    # threads (etcd keep-alives, a witness's acceptor), and a fork while one of them held a lock
    # hung every rank of a whole-suite run until the 300 s timeout.
    multiprocessing.set_forkserver_preload(["torch", __name__])
    mp.start_processes(_worker, args=(str(tmp),), nprocs=WORLD, join=True, start_method="forkserver")
    return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.slow  # starts processes
def test_gradients_are_bitwise_those_of_ddp_without_a_hook(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        for step, (want, got) in enumerate(zip(r["want"], r["got"])):
            for i, (w, g) in enumerate(zip(want, got)):
                assert torch.equal(_bits(w), _bits(g)), f"rank {rank} step {step} param {i} differs"


@pytest.mark.slow  # starts processes
def test_the_check_would_see_a_hook_that_divides_instead(results: list[dict]) -> None:
    """torch's reference hook divides by 3; our check must be able to tell it apart."""
    differs = any(
        not torch.equal(_bits(w), _bits(g))
        for r in results for want, ref in zip(r["want"], r["ref"]) for w, g in zip(want, ref)
    )
    assert differs, "x / 3 and x * (1/3) gave the same bits everywhere; the bitwise test proves nothing"


@pytest.mark.slow  # starts processes
def test_average_false_sums_the_gradients_over_ranks(results: list[dict]) -> None:
    """ElasticRun's mode: its loss carries 1/world, so the hook must not scale again."""
    for rank, r in enumerate(results):
        # step 0 only: the steps after it start from parameters updated by a sum, not a mean
        for i, (mean, summed) in enumerate(zip(r["want"][0], r["summed"][0])):
            torch.testing.assert_close(summed, mean * WORLD, rtol=1e-5, atol=1e-7,
                                       msg=f"rank {rank} param {i}: not the sum over ranks")


@pytest.mark.slow  # starts processes
def test_bytes_are_the_gradient_size_every_step_and_each_bucket_is_timed(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["world"] == WORLD
        assert r["bytes"] == r["numel"] * 4 * STEPS, f"rank {rank}: fp32 gradient bytes x {STEPS} steps"
        # DDP's first step uses one large bucket, then rebuilds them at BUCKET_CAP_MB: 1 + k, k > 1.
        assert r["count"] >= 1 + 2 * (STEPS - 1), f"rank {rank}: expected one timing per bucket, got {r['count']}"
        assert r["sum"] > 0
        assert r["errors_before"] == 0


@pytest.mark.slow  # starts processes
def test_a_collective_that_fails_is_counted_as_an_error(results: list[dict]) -> None:
    for rank, r in enumerate(results[:-1]):
        assert "raised" in r, f"rank {rank}: all-reduce with a dead peer did not fail"
        assert r["errors_after"] >= 1, f"rank {rank}: the failed all-reduce was not counted"


@pytest.mark.slow  # starts processes
def test_an_all_reduce_the_run_issues_itself_is_timed_and_counted_as_the_hooks_are(results: list[dict]) -> None:
    total = float(sum(range(1, WORLD + 1)))
    for r in results:
        assert r["timed"] == [total] * 5 and r["timed_count"] == 1 and r["timed_bytes"] == 5 * 4, r

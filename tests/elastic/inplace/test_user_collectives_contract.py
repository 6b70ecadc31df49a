"""What :mod:`elastic.inplace.user_collectives` relies on in torch, and its rule, without an agent.

If torch renames a collective, drops its ``group`` argument, or makes a lost peer raise
something the run does not recognise, these fail: the fallback (the collective left
unwrapped, a lost peer crashing the worker) would otherwise come back unnoticed.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from elastic.grad_sync import CollectiveFailure
from elastic.inplace import user_collectives
from elastic.inplace.user_collectives import WRAPPED, Guard, owned
from tests.support.torch_errors import raise_from_torch

TENSOR_COLLECTIVES = [n for n in WRAPPED if not n.endswith("_object") and not n.endswith("_object_list")]


@pytest.fixture
def world_of_one() -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        user_collectives.uninstall_all()
        dist.destroy_process_group()


def test_every_wrapped_collective_exists_with_the_arguments_the_guard_reads() -> None:
    for name in WRAPPED:
        fn = getattr(dist, name, None)
        assert fn is not None, f"torch.distributed.{name} is gone"
        params = inspect.signature(getattr(fn, "__elastic_wrapped__", fn)).parameters
        assert "group" in params, f"torch.distributed.{name} has no group argument"
        if name in TENSOR_COLLECTIVES:
            assert "async_op" in params, f"torch.distributed.{name} has no async_op argument"


def test_wrapped_collectives_return_what_torch_returns(world_of_one: None) -> None:
    guard = Guard()
    guard.install()
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    assert t.item() == 3.0 and dist.all_reduce.__name__ == "all_reduce"
    out: list[Any] = [None]
    dist.all_gather_object(out, {"lr": 0.1})
    assert out == [{"lr": 0.1}]
    config = [None]
    dist.broadcast_object_list(config if dist.get_rank() else [{"seed": 3}], src=0)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() and dist.barrier() is None
    assert guard.take() is None


def test_after_an_abandoned_step_the_loop_bodys_collectives_return_at_once_until_the_next_batch(
        world_of_one: None, caplog: pytest.LogCaptureFixture) -> None:
    guard = Guard()
    guard.install()
    guard.after_abandoned = True  # what the run sets when run.step / optimizer.step() abandoned the step
    t = torch.tensor([3.0])
    with caplog.at_level("INFO", logger=user_collectives.__name__):
        assert dist.all_reduce(t) is None and dist.barrier() is None  # skipped: no rank of the new world meets them
        assert dist.all_reduce(t, async_op=True).wait() and guard.take() is None  # skipped is not failed
    said = [r.getMessage() for r in caplog.records if "after a step the run abandoned" in r.getMessage()]
    assert len(said) == 1 and "your dist.all_reduce" in said[0], said
    with owned():
        assert dist.all_reduce(t) is None  # the run's own collectives are not skipped (a world of one: x1)
    guard.after_abandoned = False  # the next batch
    t.fill_(5.0)
    dist.all_reduce(t)
    assert t.item() == 5.0


def _fake_all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    raise_from_torch()  # a mock (a world of one loses no peer): gloo's lost peer, raised as from torch's own code


def test_a_lost_peer_is_recorded_once_and_later_calls_return_at_once(monkeypatch: pytest.MonkeyPatch,
                                                                      world_of_one: None) -> None:
    # monkeypatch first: torn down last, after world_of_one put back what the guard wrapped
    calls: list[int] = []

    def failing(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        calls.append(1)
        return _fake_all_reduce(tensor, op, group, async_op)

    monkeypatch.setattr(dist, "all_reduce", failing)
    guard = Guard()
    guard.install()
    t = torch.tensor([1.0])
    assert dist.all_reduce(t) is None and t.item() == 1.0  # returned; output as it was
    assert dist.all_reduce(t, async_op=True).wait() and len(calls) == 1  # broken group: not touched again
    failure = guard.take()
    assert isinstance(failure, CollectiveFailure) and "your dist.all_reduce failed: " in str(failure)
    assert "Connection closed by peer" in str(failure) and guard.take() is None
    with owned(), pytest.raises(RuntimeError, match="Connection closed"):
        dist.all_reduce(t)  # the run's own collectives: torch's behaviour
    guard.uninstall()
    with pytest.raises(RuntimeError, match="Connection closed"):
        dist.all_reduce(t)  # after the run: torch's behaviour


def test_other_errors_and_other_groups_raise_as_torch_does(monkeypatch: pytest.MonkeyPatch,
                                                          world_of_one: None) -> None:
    def wrong(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        raise ValueError("a user's bug")

    monkeypatch.setattr(dist, "all_reduce", wrong)
    Guard().install()
    with pytest.raises(ValueError):
        dist.all_reduce(torch.tensor([1.0]))
    user_collectives.uninstall_all()
    monkeypatch.setattr(dist, "all_reduce", _fake_all_reduce)
    guard = Guard()
    guard.install()
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.tensor([1.0]), group=object())  # a subgroup of the script's: its own business
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.tensor([1.0]), dist.ReduceOp.SUM, object())  # the same, passed by position
    assert guard.take() is None
    assert dist.all_reduce(torch.tensor([1.0]), dist.ReduceOp.SUM, None, True).wait()  # default group by position
    assert "Connection closed" in str(guard.take())


def test_uninstall_all_gives_torch_its_functions_back() -> None:
    Guard().install()
    user_collectives.uninstall_all()
    assert all(not hasattr(getattr(dist, name), "__elastic_wrapped__") for name in WRAPPED)
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"


LOST_PEER = textwrap.dedent('''\
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20))
    dist.barrier()
    if rank == 1:
        os._exit(0)  # a node lost
    from elastic.inplace.user_collectives import Guard
    guard = Guard()
    guard.install()
    t = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(t)
        time.sleep(0.2)
    failure = guard.take()
    print("RECORDED" if failure is not None else "NOTHING", failure)
    os._exit(0)
''')


@pytest.mark.slow  # starts processes
def test_a_real_peer_lost_in_a_users_all_reduce_is_recorded_not_raised(tmp_path: Any) -> None:
    from agent.etcd import free_port

    script = tmp_path / "lost_peer.py"
    script.write_text(LOST_PEER)
    port = free_port()  # both ranks need rank 0's TCPStore port on their command lines before either starts
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**__import__("os").environ,
                                                                          "OMP_NUM_THREADS": "1"})
             for r in (0, 1)]
    out = procs[0].communicate(timeout=60)[0]
    procs[1].wait(timeout=10)
    assert "RECORDED" in out, out

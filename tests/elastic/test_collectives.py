"""One classification of a collective's failure (elastic/collectives.py), by torch's types and
the error's origin; gloo's untyped words are read only for an error torch itself raised.

If torch renames or drops one of the types, or reparents it, these fail by name: the run would
otherwise take a lost peer for a bug (the job crashes instead of re-forming) without a word.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from elastic.collectives import (TORCH_TYPES, CollectiveFailure, collective_failures, failure_kind, first_line,
                                 is_collective_failure)
from elastic.contract import FailureKind
from tests.support.torch_errors import raised_in_torch

EXPECTED = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


@pytest.mark.parametrize("name", EXPECTED)
def test_torch_still_has_each_type_we_classify_by(name: str) -> None:
    cls = getattr(dist, name, None)
    assert isinstance(cls, type), f"torch.distributed.{name} is gone: update elastic/collectives.py TORCH_TYPES"
    assert issubclass(cls, dist.DistError) and issubclass(cls, RuntimeError), \
        f"torch.distributed.{name} no longer a DistError/RuntimeError: revisit elastic/collectives.py"
    assert cls in TORCH_TYPES


@pytest.mark.parametrize("name", EXPECTED)
def test_a_typed_failure_is_a_collective_failure_whatever_it_says(name: str) -> None:
    assert is_collective_failure(getattr(dist, name)("the message says nothing we know"))


GLOO_LOST = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
             "[127.0.0.1]:34022")  # torch 2.14.1, a gloo peer lost mid-all_reduce: no type
GLOO_TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms"


def raised_at(path: str, message: str) -> RuntimeError:
    """A plain RuntimeError raised by code whose file is ``path`` (its traceback says so)."""
    try:
        exec(compile(f"raise RuntimeError({message!r})", path, "exec"), {})
    except RuntimeError as exc:
        return exc
    raise AssertionError("not raised")


def test_an_untyped_runtime_error_from_torch_counts_by_what_gloo_says() -> None:
    assert failure_kind(raised_in_torch(GLOO_LOST)) is FailureKind.PEER_LOST and is_collective_failure(raised_in_torch(GLOO_LOST))
    assert failure_kind(raised_in_torch(GLOO_TIMEOUT)) is FailureKind.TIMEOUT
    assert not is_collective_failure(raised_in_torch("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError("nccl"))  # not a RuntimeError: a bug, whatever it says


def test_a_scripts_own_runtime_error_is_its_own_whatever_it_says(tmp_path: Path) -> None:
    """The words of an error the script raised itself never make it a broken world."""
    for message in ("timeout", GLOO_LOST, "peer gone"):
        own = raised_at(str(tmp_path / "train.py"), message)
        assert failure_kind(own) is FailureKind.USER and not is_collective_failure(own), message
    assert failure_kind(RuntimeError(GLOO_LOST)) is FailureKind.USER  # never raised: no origin to read


def test_kinds_by_type() -> None:
    from elastic.snapshots import StaleGroupError

    assert failure_kind(dist.DistStoreError("wait timeout")) is FailureKind.TIMEOUT
    assert failure_kind(dist.DistNetworkError("x")) is FailureKind.PEER_LOST
    assert failure_kind(CollectiveFailure("x", FailureKind.ABANDONED)) is FailureKind.ABANDONED
    assert failure_kind(StaleGroupError("a newer round commits")) is FailureKind.ABANDONED
    assert not is_collective_failure(StaleGroupError("a newer round commits"))


def test_the_wrapper_turns_a_lost_peer_into_collective_failure_and_lets_a_bug_through() -> None:
    with pytest.raises(CollectiveFailure, match="^peer gone$") as info:
        with collective_failures():
            raise dist.DistNetworkError("peer gone\nmore detail")
    assert isinstance(info.value.__cause__, dist.DistNetworkError)
    with pytest.raises(CollectiveFailure, match="^already$") as again:
        with collective_failures():
            raise CollectiveFailure("already")
    assert again.value.__cause__ is None
    with pytest.raises(RuntimeError, match="shapes"):
        with collective_failures():
            raise RuntimeError("shapes")


def test_first_line_is_one_line_or_the_type() -> None:
    assert first_line(RuntimeError("a\nb")) == "a"
    assert first_line(dist.DistStoreError("")) == "DistStoreError"


GUARD = '''\
import os, signal, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from elastic.collectives import failure_kind
from elastic.torch_untyped import raised_in_torch

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
dist.barrier()
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # a node lost: its sockets close under rank 0's all_reduce
try:
    for _ in range(100000):
        dist.all_reduce(torch.ones(1000))
except Exception as exc:
    print(f"TYPE={type(exc).__name__} IN_TORCH={raised_in_torch(exc.__traceback__)} KIND={failure_kind(exc)}")
    os._exit(0)
'''


@pytest.mark.slow
def test_a_real_gloo_peer_loss_reads_as_a_lost_peer(tmp_path: Path) -> None:
    """The guard of elastic/torch_untyped.py: gloo's lost peer, as torch raises it today."""
    from tests.support.pair import run_ranks

    out = run_ranks(GUARD, tmp_path, [0, -9], timeout=60)[0]
    assert "KIND=peer_lost" in out, out
    assert "TYPE=RuntimeError IN_TORCH=True" in out, f"torch types gloo's failure now: drop elastic/torch_untyped.py\n{out}"

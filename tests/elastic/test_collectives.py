"""One classification of a collective's failure (elastic/collectives.py), by torch's types.

If torch renames or drops one of the types, or reparents it, these fail by name: the run would
otherwise take a lost peer for a bug (the job crashes instead of re-forming) without a word.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elastic.collectives import TORCH_TYPES, CollectiveFailure, collective_failures, first_line, is_collective_failure

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


def test_an_untyped_runtime_error_counts_only_by_what_gloo_says() -> None:
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                        "[127.0.0.1]:34022")  # torch 2.14.1, a gloo peer lost mid-all_reduce: no type
    assert is_collective_failure(gloo)
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError("nccl"))  # not a RuntimeError: a bug, whatever it says


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

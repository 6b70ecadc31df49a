"""One check for "these two states are the same": nested dicts, lists and tuples of tensors and
plain values, compared exactly (dtype, shape, every element; key order too), the path of the
first difference named. The snapshot-from-host-copy tests compare whole snapshots with it."""

from __future__ import annotations

from typing import Any

import torch


def assert_same_tree(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where

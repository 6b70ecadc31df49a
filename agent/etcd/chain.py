"""An error of a given type behind another: python3-etcd3 re-raises its own types and keeps
gRPC's (or its own compaction error) only in the chain, so callers look a few links back."""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)

DEPTH = 5  # links followed: the client's wrappers add two or three


def raised_from(exc: BaseException | None, kind: type[E]) -> E | None:
    """``exc`` itself or the first error of type ``kind`` in its cause/context chain, or None."""
    for _ in range(DEPTH):
        if exc is None:
            return None
        if isinstance(exc, kind):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


__all__ = ["raised_from"]

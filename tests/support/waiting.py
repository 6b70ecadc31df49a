"""Poll with a deadline instead of sleeping and hoping."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T | None | bool],
    timeout: float,
    what: str,
    interval: float = 0.1,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Return the first truthy ``probe()``; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value  # type: ignore[return-value]  # truthy: not None, not False
        if time.monotonic() >= deadline:
            detail = f"\n{on_timeout()}" if on_timeout else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(interval)

"""A stand-in for torch's untyped collective failure, raised where torch would raise it.

gloo's lost peer is a plain ``RuntimeError`` that torch raises from its own code
(``distributed_c10d.py``); the run classifies an untyped error by that origin first
(``elastic/collectives.py``), so a stand-in raised from a test's own frame reads as the
script's own error. Tests that cannot lose a real peer (a world of one) raise it through
here; ``tests/elastic/test_collectives.py`` checks the real one against a real gloo world.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import torch

C10D = str(Path(torch.__file__).parent / "distributed" / "distributed_c10d.py")
GLOO_LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1"


def raised_in_torch(message: str = GLOO_LOST) -> RuntimeError:
    """The error, raised and caught once from a frame whose file is torch's own."""
    try:
        exec(compile(f"raise RuntimeError({message!r})", C10D, "exec"), {})
    except RuntimeError as exc:
        return exc
    raise AssertionError("not raised")


def raise_from_torch(message: str = GLOO_LOST) -> NoReturn:
    """Raise it as torch does: its traceback's innermost frame is torch's."""
    error = raised_in_torch(message)
    raise error.with_traceback(error.__traceback__)

"""The ``torchrun.handlers`` entry point, kept free of imports at module level.

torch loads entry points while ``torch.distributed.elastic.rendezvous`` is being imported,
which may itself be in the middle of importing this package; importing the handler
lazily keeps that cycle from breaking registration.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def _create_for_torchrun(params: "RendezvousParameters") -> "RendezvousHandler":
    """torchrun's creator: user errors end the process with one line, not a traceback."""
    from elastic.etcd import EtcdConfigError, EtcdError

    from .handler import create_handler
    from .signing import HmacKeyError

    try:
        return create_handler(params)
    except (EtcdConfigError, HmacKeyError, EtcdError) as exc:
        print(f"error: etcd-v3 rendezvous: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def handler_factory() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
    """A zero-argument function returning the handler creator, as torch expects."""
    return _create_for_torchrun

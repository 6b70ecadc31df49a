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


def _create(params: "RendezvousParameters", dynamic: bool) -> "RendezvousHandler":
    """torchrun's creator: user errors end the process with one line, not a traceback."""
    from agent.etcd import EtcdConfigError, EtcdError, EtcdUnavailableError

    from agent.rendezvous.signing import HmacKeyError

    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from agent.rendezvous.unreachable import EtcdUnreachableExit

    try:
        if dynamic:
            from agent.rendezvous.dynamic import create_dynamic_handler

            return create_dynamic_handler(params)
        from agent.rendezvous.handler import create_handler

        return create_handler(params)
    except (EtcdConfigError, HmacKeyError, EtcdError, ValueError, RendezvousConnectionError) as exc:
        print(f"error: {params.backend} rendezvous: {exc}", file=sys.stderr, flush=True)
        if isinstance(exc, (EtcdUnavailableError, RendezvousConnectionError)):
            raise EtcdUnreachableExit(str(exc)) from exc  # torch's type for Python callers; exit 2 for torchrun
        raise SystemExit(2) from None


def handler_factory() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
    """``etcd-v3``: a zero-argument function returning the handler creator, as torch expects."""
    return lambda params: _create(params, dynamic=False)


def dynamic_handler_factory() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
    """``etcd-v3-dynamic``: torch's DynamicRendezvousHandler over our backend (comparisons)."""
    return lambda params: _create(params, dynamic=True)

"""etcd did not answer the rendezvous factory: torch's error type and torchrun's quiet exit, both.

torch's contract (its own backend factories, its tests) is a
:class:`RendezvousConnectionError` when the store cannot be reached; Python callers catch
that type. On the command line the factory's one ``error:`` line is already out, and a
traceback would only bury it: as a :class:`SystemExit` (code 2, which torchrun's
``@record`` re-raises untouched) the process ends quietly, as it did before.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic.contract import USAGE_ERROR_EXIT


class EtcdUnreachableExit(SystemExit, RendezvousConnectionError):
    """Both a :class:`RendezvousConnectionError` and a quiet exit 2; ``str()`` is the one line."""

    def __init__(self, message: str) -> None:
        SystemExit.__init__(self, USAGE_ERROR_EXIT)
        self.message = message

    def __str__(self) -> str:
        return self.message

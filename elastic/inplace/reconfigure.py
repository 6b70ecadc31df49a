"""torch's experimental process-group reconfigure API, behind one small module.

torch 2.14 can change the members of a live default process group
(``init_process_group(..., enable_reconfigure=True)``, ``_get_reconfigure_handle``,
``_reconfigure(uuid, handles)``). The API is private and marked experimental, so nothing
else in this project touches it: :func:`unsupported_reason` says, in one line, why a torch
cannot do it (and the trainer then keeps the restart path), and
``tests/elastic/inplace/test_reconfigure_api.py`` fails loudly if torch changes what we
rely on:

* a group created with ``enable_reconfigure`` has no communicator until the first
  ``_reconfigure``; the ``rank`` given at creation is only a *stable* id;
* a handle is ``backend:rank:uuid:stable_rank:store_address``; it changes with every
  reconfigure (the uuid is in it), so handles are gathered afresh each time;
* the order of the handle list assigns the new ranks, and ``dist.get_rank()`` /
  ``get_world_size()`` follow it; handles must be unique and include the caller's own;
* gloo's own rendezvous for a reconfigure goes through the group's store;
* gloo waits five times a reconfigure's timeout for each pair to connect (torch 2.14.1),
  and nothing interrupts that wait: see :func:`reconfigure_timeout`.

A process that exits with a reconfigured group still alive aborts now and then in C++
teardown (``terminate called without an active exception``, SIGABRT, 3 exits in 40 in
the API test's script): :func:`init_group` therefore leaves the group at exit.
"""

from __future__ import annotations

import atexit
import inspect
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from ..collectives import first_line

SUPPORTED_BACKENDS = ("gloo", "nccl")
GLOO_RECONFIGURE_TIMEOUT_S = 1.0
GLOO_CONNECT_WAITS = 5  # gloo lets its connect phase last this many reconfigure timeouts (torch 2.14.1)
_API = ("_reconfigure", "_get_reconfigure_handle", "_supports_reconfigure")


class ReconfigureError(RuntimeError):
    """A reconfigure did not complete (a member never came, the store went away)."""


def unsupported_reason(backend: str) -> str | None:
    """None if this torch can reconfigure a ``backend`` group in place; else why not, in one line."""
    missing = [name for name in _API if not hasattr(dist, name)]
    if missing:
        return (f"this torch ({torch.__version__}) has no process-group reconfigure API "
                f"(torch.distributed.{missing[0]} is missing; torch 2.14 has it)")
    if "enable_reconfigure" not in inspect.signature(dist.init_process_group).parameters:
        return f"this torch ({torch.__version__}) cannot create a reconfigurable process group"
    if backend not in SUPPORTED_BACKENDS:
        return f"backend {backend!r} has no reconfigure support here (only {', '.join(SUPPORTED_BACKENDS)})"
    return None


def init_group(backend: str, store: dist.Store, stable_rank: int, stable_ranks: int, timeout: timedelta,
               device_id: torch.device | None = None) -> None:
    """Create the default group, unconnected until :func:`reconfigure` gives it members.

    ``stable_rank`` must be unique among the processes that are new in the first
    reconfigure they take part in; the worker's rank in the round it was started for is.
    """
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(backend, store=store, rank=stable_rank, world_size=stable_ranks, timeout=timeout,
                            enable_reconfigure=True, **kwargs)
    if not dist._supports_reconfigure():
        raise ReconfigureError(f"the {backend} process group was created without reconfigure support")
    atexit.unregister(_leave_at_exit)
    atexit.register(_leave_at_exit)


def skip_leave_at_exit() -> None:
    """For a failed process that leaves by ``os._exit``: destroying a group whose peer died
    waits on gloo's threads (1-3 s) before the agent may notice the failure."""
    atexit.unregister(_leave_at_exit)


def _leave_at_exit() -> None:
    """Destroy the group before C++ static teardown, where gloo's threads abort the process."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; an abort here is what we prevent
            pass


def handle() -> str:
    """This process's current handle (it changes after every reconfigure)."""
    return str(dist._get_reconfigure_handle())


def reconfigure_timeout(backend: str, collective_timeout: timedelta) -> timedelta:
    """The timeout to give :func:`reconfigure`: short for gloo.

    A member that dies after posting its address but before its pairs connect (a node
    killed in the milliseconds of a re-formation) leaves every survivor in gloo's connect
    phase for ``5 x timeout``, which no abandoned store read or shut-down socket ends: at
    the 30 s collective timeout, 150 s of a job standing still. Between live members the
    phase takes milliseconds (every member has posted its address before any pair
    connects; waiting for a slow member's address is the round store's wait, which keeps its
    own bound), so one second, five in that case, costs nothing else. The group's
    collectives keep the collective timeout. NCCL's communicator set-up can take seconds on a
    large world and keeps the collective timeout.
    """
    if backend != "gloo":
        return collective_timeout
    return min(collective_timeout, timedelta(seconds=GLOO_RECONFIGURE_TIMEOUT_S))


def reconfigure(uuid: int, handles: Sequence[str], timeout: timedelta) -> None:
    """Connect the default group to exactly ``handles``, in that rank order."""
    try:
        dist._reconfigure(uuid=uuid, handles=list(handles), timeout=timeout).wait()
    except RuntimeError as exc:
        raise ReconfigureError(first_line(exc)) from exc


def abort_backend(backend: str) -> bool:
    """NCCL's abort interrupts a collective stuck on a frozen peer; gloo's does not (see
    :mod:`.fence`). Returns whether an abort was issued."""
    if backend != "nccl" or not torch.cuda.is_available():
        return False
    group = dist.distributed_c10d._get_default_group()
    group._get_backend(torch.device("cuda")).abort()
    return True

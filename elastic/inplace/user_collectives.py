"""The script's own collectives on the default group: a lost peer fails the step, not the process.

A user's ``dist.all_reduce`` of a metric, ``dist.barrier()`` or ``dist.all_gather_object``
in the loop body runs on the run's default group, between the run's own collectives. When
a peer dies in it, gloo raises into the user's code: uncaught, the worker crashes, its
agent restarts it, and once every survivor has done so the job's replicas are gone and it
goes back to disk. Inside ``ElasticRun`` the same failure only abandons the step.

**The contract**, while a :class:`Guard` is installed (from the end of ``ElasticRun``'s
constructor until the run is closed):

* the collectives named in :data:`WRAPPED`, called as ``torch.distributed.NAME`` on the
  default group (``group`` left out, None or ``dist.group.WORLD``), that fail the way a
  lost peer makes them fail (:func:`elastic.collectives.is_collective_failure`) **return**
  instead of raising: their outputs are left as they were, and the failure is recorded;
* once one failed, the next ones return at once without touching the broken group;
* after a step the run abandoned (the world formed again inside ``run.step`` or the prepared
  ``optimizer.step()``), the ones the loop body issues before its next batch return at once
  too (:attr:`Guard.after_abandoned`), with one line the first time: every rank that
  abandoned the step skips them alike, while a joiner healed meanwhile never runs that
  step's loop body, so an unguarded ``if step % N == 0: dist.all_reduce(...)`` after the
  step met the joiner's next step and gloo aborted on the mismatched sizes;
* the run takes the failure (:meth:`Guard.take`) at its next ``run.step`` or ``next()``
  and treats it as a failure of that step: abandoned, and the world re-formed in place;
* ``async_op=True`` returns a work whose ``wait()`` follows the same rule; its
  ``get_future()`` is torch's own (a failure raises from it);
* everything else is torch's, untouched: other groups, other errors (a wrong shape, a
  wrong type), and the run's own collectives (:meth:`Guard.owned` around them, so that
  the run still sees and handles its own failures).

Only the attributes of the ``torch.distributed`` module are replaced, so a script must
call them as ``dist.NAME`` (a name imported with ``from torch.distributed import
all_reduce`` before the run was built is torch's own, and raises as before). Nested calls
(``all_gather_object`` calling ``all_gather``) pass through to torch.

**Fallback.** A function whose signature this module does not recognise (a future torch)
is left unwrapped, with one warning naming it: its failures then raise into the script,
and the worker is restarted by its agent, as before. ``tests/elastic/inplace/
test_user_collectives_contract.py`` fails loudly when torch changes what this relies on.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from typing import Any, Callable, Iterator

import torch.distributed as dist

from ..collectives import CollectiveFailure, first_line, is_collective_failure

log = logging.getLogger(__name__)

WRAPPED = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce", "gather",
           "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
           "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")

USER_FAILURE_PREFIX = "your dist."  # how a recorded failure's message starts (the run's line names it)


class UserCollectiveFailure(CollectiveFailure):
    """The script's own ``dist.*`` call broke the world (recorded by :class:`Guard`): the run's
    line names that call, by this type, never by the message's words."""

_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_active: "Guard | None" = None
_depth = 0  # > 0: the run's own collectives, or a wrapped call already under way (process-wide: DDP's
# comm hooks may run on autograd's threads)


class Guard:
    """Records the first failure of a user collective on the default group; see the module doc."""

    def __init__(self) -> None:
        self.failure: CollectiveFailure | None = None
        self.where = ""  # the function that failed first, for the log
        self.after_abandoned = False  # set by the run after an abandoned step, until its next batch
        self._said_skip = False

    def install(self) -> None:
        global _active
        with _lock:
            for name in WRAPPED:
                if name in _originals:
                    continue
                original = getattr(dist, name, None)
                if original is None or not _recognised(original):
                    log.warning("torch.distributed.%s is not wrapped (unknown signature in this torch): a lost peer "
                                "in it raises into your code and the worker is restarted", name)
                    continue
                _originals[name] = original
                setattr(dist, name, _wrap(name, original))
            _active = self

    def uninstall(self) -> None:
        global _active
        with _lock:
            if _active is self:
                _active = None

    def take(self) -> CollectiveFailure | None:
        failure, self.failure = self.failure, None
        return failure

    def skipped(self, name: str) -> None:
        if not self._said_skip:
            self._said_skip = True
            log.info("your dist.%s after a step the run abandoned (the world formed again) was skipped, as every "
                     "collective of the loop body is until the next batch: issue per-step collectives only after a "
                     "trained step (if run.step(loss): / if optimizer.step():)", name)

    def record(self, name: str, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = UserCollectiveFailure(f"{USER_FAILURE_PREFIX}{name} failed: {first_line(exc)}")
            self.where = name
            log.debug("dist.%s failed (recorded; the run abandons the step): %s", name, exc)


@contextlib.contextmanager
def owned() -> Iterator[None]:
    """The run's own collectives: torch's behaviour exactly (they raise, and the run handles it)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def uninstall_all() -> None:
    """Put torch's functions back (tests)."""
    global _active
    with _lock:
        for name, original in _originals.items():
            setattr(dist, name, original)
        _originals.clear()
        _active = None


def _recognised(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "group" in params


class _Argument:
    """Where one parameter of a collective stands: by keyword, or at its position. Read per
    call instead of ``Signature.bind``, which cost a tenth of a millisecond per bucket of
    every DDP step (the gradient hook's ``all_reduce`` passes through here too)."""

    def __init__(self, signature: inspect.Signature, name: str, default: Any) -> None:
        names = list(signature.parameters)
        self.name, self.default = name, default
        kind = signature.parameters[name].kind if name in names else None
        positional = kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.position = names.index(name) if positional else None

    def of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.name in kwargs:
            return kwargs[self.name]
        if self.position is not None and self.position < len(args):
            return args[self.position]
        return self.default


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    group_arg, async_arg = _Argument(signature, "group", None), _Argument(signature, "async_op", False)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _depth
        guard = _active
        if guard is None or _depth > 0 or not dist.is_initialized():
            return original(*args, **kwargs)
        group = group_arg.of(args, kwargs)
        if group is not None and group is not dist.group.WORLD:
            return original(*args, **kwargs)
        async_op = bool(async_arg.of(args, kwargs))
        if guard.after_abandoned:  # the abandoned step's loop body: no rank of the new world meets it
            guard.skipped(name)
            return _DoneWork() if async_op else None
        if guard.failure is not None:  # the group is broken: do not wait on it again
            return _DoneWork() if async_op else None
        _depth += 1
        try:
            result = original(*args, **kwargs)
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            guard.record(name, exc)
            return _DoneWork() if async_op else None
        finally:
            _depth -= 1
        if async_op and result is not None:
            return _GuardedWork(result, guard, name)
        return result

    wrapper.__elastic_wrapped__ = original  # type: ignore[attr-defined]  # our mark on a function object
    return wrapper


class _DoneWork:
    """What an ``async_op=True`` call returns when it did not run (the group was broken)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return False


class _GuardedWork:
    """torch's work, whose ``wait()`` records a lost peer instead of raising it."""

    def __init__(self, work: Any, guard: Guard, name: str) -> None:
        self._work, self._guard, self._name = work, guard, name

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        try:
            return bool(self._work.wait(*args, **kwargs))
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            self._guard.record(self._name, exc)
            return False

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._work, attr)


__all__ = ["Guard", "USER_FAILURE_PREFIX", "UserCollectiveFailure", "WRAPPED", "owned", "uninstall_all"]

"""The loop's own state, registered with the run: healed and snapshotted with the model.

In place, a process outlives the world it started in, and a joiner starts in the middle
of a run. So what a training loop keeps besides model and optimizer (an epoch counter, a
running loss sum, an EMA model, the best loss so far) must travel where the model goes:
to a rank healed from a survivor, and into snapshots for a resume from disk. A loop that
keeps it in fresh locals crashes or lies after every heal (a joiner's ``loss_sum / n``
with ``n == 0``). ``run.register(name, obj)`` makes ``obj`` part of the run's state tree,
under ``"user"``:

* an object with ``state_dict()`` and ``load_state_dict()`` (a module, an optimizer, a
  :class:`Holder`) is saved and restored through them;
* a ``dict`` or a ``list`` is copied when read and restored **in place** (cleared and
  refilled), so every reference the loop holds sees the restored values; a tensor value
  goes back to the device of the tensor it replaces; a tensor is restored by ``copy_``;
* a plain number or string cannot be changed in place: register a dict
  (``{"loss": inf}``) or a :class:`Holder` and use ``.value``.

**What a registered value means: its value as of the last committed step.** The run
reads the tree only between the loop's code for one step and its next ``run.step``: a
snapshot of step k is taken inside ``run.step`` of step k+1 (before its optimizer step),
and a world changes only inside ``run.step`` of a step it abandons or at the top of the
loop. So a rank's registered values stand at step k whenever its model does, provided
the loop changes them only after ``run.step(loss)`` returned true. A rank that abandoned a
step the world then trained (it is healed forward) gets the trainers' values, which
already count that step; its own ``run.step`` returned false, so it does not count it
again.

Values restored for a name not registered yet wait for it: a joiner is healed while its
``ElasticRun`` is being built, before its script can register anything, and gets them at
its ``register`` call, right after.
"""

from __future__ import annotations

from collections.abc import MutableMapping, MutableSequence
from typing import Any, Generic, Mapping, TypeVar

import torch

from checkpoints import SnapshotError
from checkpoints.tree import map_state

from .distributed import ElasticRunError

T = TypeVar("T")
V = TypeVar("V")


class Holder(Generic[V]):
    """One value the loop rebinds (a best loss, a patience counter), registered with the run:
    ``best = run.register("best", Holder(float("inf")))``, then ``best.value = ...``."""

    def __init__(self, value: V) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = state["value"]

    def __repr__(self) -> str:
        return f"Holder({self.value!r})"


def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _kind(name: str, obj: Any) -> str:
    if _has_state_dict(obj):
        return "state_dict"
    if isinstance(obj, MutableMapping):
        return "dict"
    if isinstance(obj, MutableSequence):
        return "list"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if isinstance(obj, (int, float, complex, str, bytes, tuple)) or obj is None:
        raise ElasticRunError(
            f"run.register({name!r}, {obj!r}): the run cannot update this value in place (your own name for it "
            f"would keep the old value); register a dict such as {{'value': {obj!r}}} or "
            f"elastic.user_state.Holder({obj!r}) and use its entries or .value"
        )
    raise ElasticRunError(
        f"run.register({name!r}, ...): a {type(obj).__qualname__} has no state_dict() and load_state_dict() and is "
        "not a dict, list or tensor; register its state in a dict, or give it those two methods"
    )


def _read(obj: Any, kind: str) -> Any:
    if kind == "state_dict":
        return obj.state_dict()
    if kind == "tensor":
        return obj.detach()
    return dict(obj) if kind == "dict" else list(obj)


def _on_device_of(old: Any, new: Any) -> Any:
    """A restored tensor (from a file or over gloo: on the CPU) where the loop kept its own."""
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and new.device != old.device:
        return new.to(old.device)
    return new


def _write(obj: Any, kind: str, value: Any) -> None:
    if kind == "state_dict":
        obj.load_state_dict(value)
    elif kind == "tensor":
        with torch.no_grad():
            obj.copy_(value)
    elif kind == "dict":
        old = dict(obj)
        obj.clear()
        obj.update({k: _on_device_of(old.get(k), v) for k, v in value.items()})
    else:
        old_items = list(obj)
        obj[:] = [_on_device_of(old_items[i] if i < len(old_items) else None, v) for i, v in enumerate(value)]


class UserState:
    """The registered objects of one run, by name; read and written as one subtree."""

    def __init__(self) -> None:
        self._objects: dict[str, tuple[Any, str]] = {}  # name -> (object, how it is read and written)
        self._waiting: dict[str, Any] = {}  # restored values whose name is not registered yet

    def __len__(self) -> int:
        return len(self._objects)

    def names(self) -> list[str]:
        return list(self._objects)

    def register(self, name: str, obj: T) -> T:
        """Add ``obj`` under ``name`` (checked now, not at the first snapshot); a value
        restored for ``name`` before it was registered is loaded into it at once."""
        if not isinstance(name, str) or not name:
            raise ElasticRunError(f"run.register: the name must be a non-empty str, got {name!r}")
        known = self._objects.get(name)
        if known is not None:
            if known[0] is obj:
                return obj
            raise ElasticRunError(f"run.register({name!r}, ...): that name is registered already, for another "
                                  "object; give each object its own name")
        kind = _kind(name, obj)
        self._copy(name, _read(obj, kind))  # a value snapshots cannot hold fails here, naming its entry
        self._objects[name] = (obj, kind)
        if name in self._waiting:
            self._load(name, self._waiting.pop(name))
        return obj

    def capture(self) -> dict[str, Any]:
        """Every registered value, in fresh containers (the loop may change its own right after)."""
        return {name: self._copy(name, _read(obj, kind)) for name, (obj, kind) in self._objects.items()}

    def restore(self, tree: Mapping[str, Any] | None) -> None:
        """Load a captured subtree (a replica's or a snapshot's); names not registered yet wait."""
        if tree is None:
            return
        self._waiting = {}
        for name, value in tree.items():
            if name in self._objects:
                self._load(name, value)
            else:
                self._waiting[str(name)] = value

    def _load(self, name: str, value: Any) -> None:
        obj, kind = self._objects[name]
        try:
            _write(obj, kind, value)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise ElasticRunError(
                f"registered state {name!r} does not match what the run restored ({str(exc).splitlines()[0]}); "
                "register the same kind of object under that name as the run that saved it, or use a new name"
            ) from None

    @staticmethod
    def _copy(name: str, value: Any) -> Any:
        try:
            return map_state(value, lambda t, _where: t, where=f"registered state {name!r}")
        except SnapshotError as exc:
            raise ElasticRunError(str(exc)) from None


__all__ = ["Holder", "UserState"]

"""The world a run trains in: how it forms, is replaced, fails and closes.

:class:`ElasticRun` trains the same way in either of two worlds, chosen once when it is
built (:func:`choose_world`), and asks the world, never the mode, what to do:

* :class:`~elastic.fixed_world.FixedWorld`: torchrun's process group (plain torchrun,
  ``--no-in-place``, a torch that cannot reconfigure a group). It cannot lose a member: a
  lost peer ends the worker and its agent restarts every worker, and every start restores
  the newest snapshot.
* :class:`~elastic.inplace.in_place_world.InPlaceWorld`: the rounds ``elastic agent``
  offers. The same processes re-form around a lost or joining node, agree on a step and
  heal whoever needs state from a live replica.

The run calls a world in this order:

1. :meth:`TrainingWorld.connect` once, in the constructor: the process group this rank
   starts in (the run builds its metrics, DDP and snapshots on it).
2. :meth:`~TrainingWorld.start` once, after those are built: the first world, with state.
3. :meth:`~TrainingWorld.enter_loop` at the loop's first batch.
4. Every step: :meth:`~TrainingWorld.replaced_by` and :meth:`~TrainingWorld.control_value`
   before the forward, :meth:`~TrainingWorld.stepped` after the optimizer step, and
   :meth:`~TrainingWorld.offers` with the value the control all-reduce agreed on; at the
   step boundary after it, :meth:`~TrainingWorld.switch` if it offered one.
5. A collective failed: :meth:`~TrainingWorld.lost_peer`; a peer stopped after SIGTERM:
   :meth:`~TrainingWorld.peers_stopped`. Each either forms the next world or does not return.
6. :meth:`~TrainingWorld.close` once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from .distributed import DistInfo

if TYPE_CHECKING:
    from .trainer import ElasticRun


class TrainingWorld(ABC):
    """One recovery path's answer to each moment of the run where the two paths differ."""

    #: A peer stopping after SIGTERM ends this world, so the job resumes from disk: rank 0
    #: writes a snapshot of the step every rank finished even when it does not leave.
    restarts_from_disk: bool = False
    #: This rank runs the script's set-up in a world of its own (a joiner, see
    #: :mod:`elastic.worker_env`); what rank 0 would say for the job is not its to say.
    in_setup_world: bool = False
    #: The script's own default process group, replaced by this world's (for the start-up line).
    took_group: str | None = None

    def __init__(self, run: "ElasticRun") -> None:
        self.run = run

    @property
    @abstractmethod
    def round(self) -> int:
        """The agent's rendezvous round this world belongs to (-1: not under ``elastic agent``)."""

    @abstractmethod
    def connect(self) -> DistInfo:
        """The process group this rank starts in."""

    @abstractmethod
    def start(self) -> None:
        """Form the first world and give this rank its state (from disk or a replica)."""

    def enter_loop(self) -> None:
        """At the loop's first batch, before the first step."""

    def replaced_by(self) -> int | None:
        """A newer round that replaces this world: the step about to start is abandoned."""
        return None

    @abstractmethod
    def control_value(self, agree_stop: bool) -> int | None:
        """What this rank puts in the step's control all-reduce (MAX), or None when the
        step needs none (``agree_stop``: a SIGTERM must be agreed on across the ranks)."""

    def stepped(self, step: int) -> None:
        """``step`` was applied on this rank."""

    def offers(self, ready: int) -> bool:
        """The control all-reduce agreed on ``ready``: a world to switch to at the boundary."""
        return False

    def switch(self, ready: int) -> None:
        """At the step boundary after :meth:`offers` was true: form that world."""
        raise NotImplementedError(f"{type(self).__name__} offers no world to switch to")

    @abstractmethod
    def lost_peer(self, step: int, noticed: str, user_collective: str) -> None:
        """Step ``step`` was abandoned because a collective failed (``noticed``: how, in a
        few words; ``user_collective``: the script's own collective that failed, if it was
        one). Form the next world, or do not return."""

    @abstractmethod
    def peers_stopped(self, step: int, said: str, leavers: list[int], broke: str) -> None:
        """Ranks ``leavers`` stopped after ``step`` (SIGTERM on their node) and this one goes
        on (``broke``: the collective error, if the world broke as they stopped). Form the
        next world, or do not return."""

    @abstractmethod
    def close(self) -> None:
        """The run is over: leave (or hand back) the process group."""


def choose_world(run: "ElasticRun", backend: str, timeout: float, in_place: bool | None,
                 owns_group: bool, off_reason: str | None = None) -> TrainingWorld:
    """In place when the agent offers rounds, ``in_place`` is not False and this torch can
    reconfigure the chosen backend (else one line says why not); torchrun's world otherwise.
    ``off_reason``: why this run cannot recover in place (a sharded model), said once and
    told to the agent, so that a lost or joining node restarts the workers."""
    from .fixed_world import FixedWorld
    from .inplace.channel import WorkerChannel

    channel = WorkerChannel.from_env()
    if channel is None or in_place is False:
        return FixedWorld(run, backend, timeout, owns_group)  # a group the script made stays as it is
    if off_reason is not None:
        from .inplace.in_place_world import restart_instead

        restart_instead(channel, off_reason)
        return FixedWorld(run, backend, timeout, owns_group)
    from .inplace.in_place_world import InPlaceWorld, in_place_off_reason

    why_not, chosen = in_place_off_reason(channel, backend)
    if why_not is not None:
        return FixedWorld(run, backend, timeout, owns_group)
    return InPlaceWorld(run, channel, chosen, timeout, owns_group)


__all__ = ["TrainingWorld", "choose_world"]

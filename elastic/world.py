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

The two worlds answer the run through :class:`~elastic.formation.TrainingWorld` and never
touch the run itself (:mod:`elastic.formation` says how, and in what order the run asks).
"""

from __future__ import annotations

from .fixed_world import FixedWorld
from .formation import TrainingWorld
from .inplace.channel import WorkerChannel
from .inplace.in_place_world import InPlaceWorld, in_place_off_reason, restart_instead


def choose_world(backend: str, timeout: float, in_place: bool | None, owns_group: bool,
                 off_reason: str | None = None) -> TrainingWorld:
    """In place when the agent offers rounds, ``in_place`` is not False and this torch can
    reconfigure the chosen backend (else one line says why not); torchrun's world otherwise.
    ``off_reason``: why this run cannot recover in place (a sharded model), said once and
    told to the agent, so that a lost or joining node restarts the workers."""
    channel = WorkerChannel.from_env()
    if channel is None or in_place is False:
        return FixedWorld(backend, timeout, owns_group)  # a group the script made stays as it is
    if off_reason is not None:
        restart_instead(channel, off_reason)
        return FixedWorld(backend, timeout, owns_group)
    why_not, chosen = in_place_off_reason(channel, backend)
    if why_not is not None:
        return FixedWorld(backend, timeout, owns_group)
    return InPlaceWorld(channel, chosen, timeout, owns_group)


__all__ = ["TrainingWorld", "choose_world"]

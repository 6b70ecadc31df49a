"""The library's lines to the user: that they reach them, and what a re-formation's says.

Python drops the INFO records of a logger nobody configured and prints its warnings bare
(``logging.lastResort``). A script that builds an ``ElasticRun`` without
``logging.basicConfig`` therefore showed a raw gloo error at a node loss and never the
line saying what happened. So the ``elastic`` logger gets a **stand-in** handler on
stderr (:func:`show_library_lines`, called by the worker bootstrap of ``elastic agent``
and by ``ElasticRun``), under one rule:

* the stand-in writes a record only when no other handler on the record's way to the
  root would: once the user configures logging (``basicConfig``, a handler on the root
  or on ``elastic``), before the library starts or after, their handlers print the
  library's lines and the stand-in stays silent, so no line is ever printed twice;
* it sets the ``elastic`` logger's level (INFO) only while nobody configured logging,
  and hands it back (NOTSET, the user's levels rule) once someone has, so that a user's
  ``basicConfig(level=WARNING)`` made before ``ElasticRun`` is built is obeyed;
* ``ELASTIC_LOG_LEVEL`` (``DEBUG``, ``INFO``, the default, ``WARNING``, ``ERROR``, or
  ``OFF`` for no stand-in at all) turns the stand-in's lines down; with logging
  configured, ``logging.getLogger("elastic").setLevel(...)`` does.

The root logger is never touched: the user's own loggers and third-party libraries keep
Python's defaults.

A re-formation is one line on rank 0, in words (:func:`reformed_line`): who was lost,
how it was noticed (:func:`how_noticed`), how long the world took to form again, and that
it did so warm, in place. A raw gloo message (``[.../pair.cc:545] Read error ...``) says
none of that; it goes to DEBUG.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Sequence

from . import contract
from .noticed import BY_THE_AGENTS, Noticed  # re-exported: the line's words

LIBRARY = "elastic"
OFF = "OFF"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class StandIn(logging.StreamHandler):
    """stderr, for the library's records that no handler of the user's would print."""

    def __init__(self) -> None:
        super().__init__()  # sys.stderr
        self.set_level_itself = False  # whether it set the library logger's level (and may hand it back)
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if someone_else_prints(record.name, self):
            return
        super().emit(record)


def someone_else_prints(name: str, me: logging.Handler | None = None) -> bool:
    """Whether a handler other than ``me`` sits on the way from logger ``name`` to the root,
    as far as propagation goes: the place a record logged there would be printed."""
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        if any(handler is not me for handler in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def parse_level(text: str) -> int | None:
    """A level from ``ELASTIC_LOG_LEVEL``: None for OFF; INFO for anything unknown."""
    value = text.strip().upper()
    if value in (OFF, "NONE", "0"):
        return None
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value)
    return level if isinstance(level, int) else logging.INFO


def show_library_lines(env: Mapping[str, str] | None = None) -> StandIn | None:
    """Apply the module's rule now; idempotent, so each entry point calls it. Returns the
    stand-in when one is installed."""
    env = os.environ if env is None else env
    level = parse_level(env.get(contract.LOG_LEVEL_ENV, "INFO"))
    library = logging.getLogger(LIBRARY)
    stand_in = next((h for h in library.handlers if isinstance(h, StandIn)), None)
    if level is None or someone_else_prints(LIBRARY, stand_in):
        if stand_in is not None:
            library.removeHandler(stand_in)
            if stand_in.set_level_itself:
                library.setLevel(logging.NOTSET)  # the user's configuration decides from now on
        return None
    if stand_in is None:
        stand_in = StandIn()
        library.addHandler(stand_in)
    if library.level == logging.NOTSET or stand_in.set_level_itself:
        library.setLevel(level)
        stand_in.set_level_itself = True
    return stand_in


# ---------------------------------------------------------------------- a re-formation, in words


def how_noticed(failure: Noticed | BaseException | str, replaced: bool = False) -> str:
    """How a rank learnt that its world broke: by the failure's own :class:`Noticed` (a
    :class:`~elastic.collectives.CollectiveFailure` carries it); a bare message is torch's,
    read in :mod:`elastic.torch_untyped` alone. ``replaced``: the agents' newer round had
    already replaced the world by then."""
    if replaced:
        return BY_THE_AGENTS
    noticed = failure if isinstance(failure, Noticed) else getattr(failure, "noticed", None)
    if not isinstance(noticed, Noticed):
        from .torch_untyped import untyped_noticed

        noticed = untyped_noticed(str(failure))
    return noticed.value


def _ranks(ranks: Sequence[int]) -> str:
    ordered = sorted(ranks)
    if not ordered:
        return ""
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f" (ranks {ordered[0]}-{ordered[-1]})"
    return f" (rank{'s' if len(ordered) > 1 else ''} {', '.join(map(str, ordered))})"


def nodes_phrase(nodes: Sequence[str], ranks: Mapping[str, Sequence[int]] | None = None) -> str:
    """``node b (rank 1)``, ``nodes b (rank 1), c (ranks 2, 3)``."""
    ranks = ranks or {}
    named = ", ".join(f"{n}{_ranks(ranks.get(n, ()))}" for n in nodes)
    return f"node{'s' if len(nodes) > 1 else ''} {named}"


def reformed_line(*, lost: Sequence[str], joined: Sequence[str], lost_ranks: Mapping[str, Sequence[int]],
                  failed_step: int | None, noticed: str, seconds: float, old_world: int, new_world: int,
                  at_step: int, round_number: int, note: str = "") -> str:
    """Rank 0's one line for a world formed again in place (after a failure or a join)."""
    by_round = noticed == BY_THE_AGENTS
    if failed_step is not None and lost:
        how = "the agents' new round left it out" if by_round else noticed
        what = f"lost {nodes_phrase(lost, lost_ranks)} in step {failed_step}: {how}"
        if joined:
            what += f"; {nodes_phrase(joined)} joined"
    elif failed_step is not None:
        how = "was given up for the agents' new round" if by_round else f"failed ({noticed})"
        what = f"step {failed_step} {how}, with every node still in the world"
    elif joined:
        what = f"{nodes_phrase(joined)} joined"
    else:
        what = "the agents opened a new round"
    return (f"{what}; re-formed in place in {seconds:.2f} s, warm (no process restarted): world of {old_world} -> "
            f"{new_world} at step {at_step}{note}, round {round_number}")


__all__ = ["BY_THE_AGENTS", "Noticed", "StandIn", "how_noticed", "nodes_phrase", "parse_level",
           "reformed_line", "show_library_lines", "someone_else_prints"]

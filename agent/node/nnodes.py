"""Which ``--nnodes`` the agent runs with: the flag, then ``ELASTIC_NNODES``, then ``PET_NNODES``.

Three parties can name the node range, and they mean different things:

- ``--nnodes`` on the command line is what the person starting the agent typed;
- ``ELASTIC_NNODES`` is our own setting, written by whoever deployed the job (a ConfigMap,
  ``agent.env``, a training runtime);
- ``PET_NNODES`` is torchrun's channel for whatever launches it. Kubeflow Trainer v2's torch
  runtime sets it to the TrainJob's fixed ``numNodes``; the legacy PyTorchJob operator set
  ``MIN:MAX`` from its ``elasticPolicy``.

So the most explicit wins, and a launcher's fixed count never silently turns an elastic job
into a fixed-size one: when ``PET_NNODES`` is set but loses, and says something else, one
warning line names both values. Nothing set at all means torchrun's default, ``1:1``.

The decisions are pure (:func:`resolve_nnodes`, :func:`settle_nnodes`); :func:`apply_nnodes`
is the thin part that turns them into an exit or a log line for ``elastic agent``.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Mapping

from elastic import contract

FLAG = "--nnodes"
TORCHRUN = "PET_NNODES"
DEFAULT = "1:1"  # torchrun's own default
HOW = "give N or MIN:MAX with 1 <= MIN <= MAX, e.g. 1:4"

log = logging.getLogger(__name__)


class NNodesError(ValueError):
    """A node range that is not ``N`` or ``MIN:MAX`` with ``1 <= MIN <= MAX``."""


@dataclass(frozen=True)
class NNodes:
    """The range the agent runs with, where it came from, and what to warn about."""

    value: str  # as torchrun takes it: "N" or "MIN:MAX"
    source: str  # FLAG, contract.NNODES_ENV, TORCHRUN or "default"
    low: int
    high: int
    warning: str | None = None


def parse_nnodes(text: str, where: str) -> tuple[int, int]:
    """``"4"`` -> (4, 4), ``"1:4"`` -> (1, 4); anything else raises :class:`NNodesError`
    naming ``where`` the value came from."""
    parts = text.strip().split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise NNodesError(f"{where} {text!r} is not N or MIN:MAX; {HOW}") from None
    if not 1 <= low <= high:
        raise NNodesError(f"{where} {text!r}: need 1 <= MIN <= MAX; {HOW}")
    return low, high


def _given(value: str | None) -> bool:
    return value is not None and value.strip() != ""


def _named(source: str, value: str) -> str:
    return f"{FLAG} {value}" if source == FLAG else f"{source}={value}"


def environment_nnodes(env: Mapping[str, str]) -> str:
    """What the environment alone asks for (unchecked): ``ELASTIC_NNODES``, else
    ``PET_NNODES``, else ``1:1``. The agent's parser takes it as the flag's default."""
    for name in (contract.NNODES_ENV, TORCHRUN):
        if _given(env.get(name)):
            return env[name].strip()
    return DEFAULT


def resolve_nnodes(flag: str | None, env: Mapping[str, str]) -> NNodes:
    """The rule. ``flag`` is ``--nnodes`` when given on the command line, else None.
    Empty values count as unset. Only the winner is checked: a value that loses is not
    the job's business, except that a losing ``PET_NNODES`` which says something else is
    worth one warning line."""
    for source, value in ((FLAG, flag), (contract.NNODES_ENV, env.get(contract.NNODES_ENV)), (TORCHRUN, env.get(TORCHRUN))):  # noqa: B007 - read after the loop
        if _given(value):
            assert value is not None
            text = value.strip()
            break
    else:
        source, text = "default", DEFAULT
    low, high = parse_nnodes(text, FLAG if source in (FLAG, "default") else source)
    warning = _pet_warning(source, text, (low, high), env) if source in (FLAG, contract.NNODES_ENV) else None
    return NNodes(value=text, source=source, low=low, high=high, warning=warning)


def _pet_warning(source: str, text: str, chosen: tuple[int, int], env: Mapping[str, str]) -> str | None:
    pet = env.get(TORCHRUN)
    if not _given(pet):
        return None
    assert pet is not None
    pet = pet.strip()
    winner = _named(source, text)
    try:
        theirs = parse_nnodes(pet, TORCHRUN)
    except NNodesError:
        return f"{TORCHRUN}={pet} is not N or MIN:MAX and is ignored: {winner} wins"
    if theirs == chosen:
        return None
    low, high = chosen
    if theirs[0] == theirs[1] and low < high:
        return (f"{TORCHRUN}={pet} (a fixed node count, as Kubeflow Trainer sets it) is ignored: "
                f"{winner} wins, so the job stays elastic between {low} and {high} nodes")
    return f"{TORCHRUN}={pet} is ignored: {winner} wins"


def settle_nnodes(parsed: str, env: Mapping[str, str]) -> NNodes:
    """The rule applied after argparse, whose ``--nnodes`` default is
    :func:`environment_nnodes`: a parsed value that differs from it came from the flag.
    (A flag equal to the environment's choice changes nothing, so which one is named
    the source does not matter.)"""
    flag = parsed if parsed.strip() != environment_nnodes(env) else None
    return resolve_nnodes(flag, env)


def apply_nnodes(parser: argparse.ArgumentParser, parsed: str, env: Mapping[str, str]) -> str:
    """For ``elastic agent``'s main: the value to run with; a bad one ends the agent with
    one line and exit 2, and a ``PET_NNODES`` that loses is logged once."""
    try:
        chosen = settle_nnodes(parsed, env)
    except NNodesError as exc:
        parser.exit(2, f"error: {exc}\n")
    if chosen.warning:
        log.warning(chosen.warning)
    return chosen.value

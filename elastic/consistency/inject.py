"""A fault to rehearse with: flip one bit of one element of a live tensor.

What a flaky GPU, a bad DIMM or a cosmic ray does to a replica, made on purpose, so the
replica check (:mod:`.check`) can be seen at work: ``elastic inject-sdc`` (through the
node's agent) or a test script calls :func:`flip_bit` on a parameter, an optimizer state
tensor or a registered tensor of one worker, between two steps.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from .. import contract, worker_env
from ..atomic_file import write_atomically
from .ondemand import take_once

log = logging.getLogger(__name__)


def flip_bit(t: torch.Tensor, index: int = 0, bit: int = 0) -> None:
    """Flip bit ``bit`` of element ``index`` (of the flattened tensor), in place."""
    if t.numel() == 0:
        raise ValueError("cannot flip a bit of an empty tensor")
    flat = t.detach().view(-1)
    index %= flat.numel()
    bits = flat.element_size() * 8
    if not 0 <= bit < bits:
        raise ValueError(f"bit {bit} is outside a {bits}-bit element")
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    word = flat.view(ints)
    with torch.no_grad():
        mask = (1 << bit) if bit < bits - 1 else -(1 << bit)  # the sign bit, as a signed mask
        word[index : index + 1].bitwise_xor_(torch.tensor(mask, dtype=ints, device=t.device))


KINDS = ("bit", "nan", "inf")  # a flipped bit; a NaN or an Inf written over one element


def poison(t: torch.Tensor, kind: str, index: int = 0) -> None:
    """Write a NaN or an Inf over element ``index`` of a floating tensor, in place: what a
    fault that leaves a non-finite value on one rank does (``kind`` "bit": flip bit 22)."""
    if kind == "bit":
        flip_bit(t, index, 22)
        return
    if kind not in KINDS:
        raise ValueError(f"unknown corruption {kind!r}: one of {', '.join(KINDS)}")
    if not t.is_floating_point():
        raise ValueError(f"cannot write a {kind} into a {t.dtype} tensor")
    if t.numel() == 0:
        raise ValueError("cannot write into an empty tensor")
    with torch.no_grad():
        t.detach().view(-1)[index % t.numel()] = float("nan") if kind == "nan" else float("inf")


def _done(kind: str) -> str:
    return "flipped bit 22 of" if kind == "bit" else f"wrote {'a NaN' if kind == 'nan' else 'an Inf'} into"


FIRST = "first"  # what ``elastic inject-sdc`` asks for without --tensor: the first parameter
_NAMED = 8  # tensors a refusal names, at most


def resolve(module: torch.nn.Module, optimizer: torch.optim.Optimizer, what: str) -> tuple[str, torch.Tensor]:
    """``(name, tensor)`` of what ``what`` names: a parameter (``fc.weight``), or
    ``<parameter>.<state>`` for its optimizer state (``fc.weight.exp_avg_sq``); ``first`` is
    the first parameter, by its own name. KeyError (one line naming the tensors there are)
    if there is no such tensor."""
    params = dict(module.named_parameters())
    if what == FIRST and params:
        return next(iter(params.items()))
    if what in params:
        return what, params[what]
    name, _, key = what.rpartition(".")
    state: dict[str, Any] = optimizer.state.get(params[name], {}) if name in params else {}
    value = state.get(key)
    if not isinstance(value, torch.Tensor):
        raise KeyError(f"no parameter or optimizer state named {what!r}; {tensors_there(module, optimizer)}")
    return what, value


def tensors_there(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The tensors a request may name, in a few words: the parameters, and the optimizer's
    state as ``<parameter>.<key>``."""
    params = dict(module.named_parameters())
    names = list(params)
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    keys = sorted({k for p in params.values() for k, v in optimizer.state.get(p, {}).items()
                   if isinstance(v, torch.Tensor)})
    state = (f"; optimizer state: <parameter>.{{{','.join(keys)}}}, e.g. {names[0]}.{keys[0]}" if keys and names
             else "; no optimizer state yet")
    return f"parameters: {', '.join(names[:_NAMED])}{more}{state}" if names else "the model has no parameters"


def target(module: torch.nn.Module, optimizer: torch.optim.Optimizer, what: str) -> torch.Tensor:
    """The tensor ``what`` names (:func:`resolve`)."""
    return resolve(module, optimizer, what)[1]




def request_flip(heartbeat_dir: str | os.PathLike[str], local_rank: int, what: str, kind: str = "bit",
                 request_id: float | None = None) -> Path:
    """The agent's side: ask local rank ``local_rank`` to flip a bit of ``what`` (or write a
    NaN or an Inf into it: ``kind``), written whole; with ``request_id`` the worker leaves
    its outcome for the agent to pass on (:func:`take_flip_result`)."""
    path = Path(heartbeat_dir) / contract.SDC_INJECT_FILE.format(local_rank=local_rank)
    body: dict[str, Any] = {"what": what, "kind": kind}
    if request_id is not None:
        body["id"] = request_id
    write_atomically(path, json.dumps(body).encode())
    return path


def take_flip_result(heartbeat_dir: str | os.PathLike[str], local_rank: int = 0) -> dict[str, Any] | None:
    """The agent's side: the outcome a worker left (``id``, ``done``, ``line``), taken once
    (None: none yet, or unreadable)."""
    return take_once(Path(heartbeat_dir) / contract.SDC_RESULT_FILE.format(local_rank=local_rank))


class FlipRequests:
    """The worker's side: one ``stat`` per step boundary; a request is taken once, removed,
    and carried out on this rank's live state (a bad request is one line, never a crash).
    Its outcome, one line naming the tensor changed or the tensors there are, goes back to
    the agent for ``elastic inject-sdc`` to print."""

    def __init__(self) -> None:
        env = worker_env.read()
        where, local_rank = env.node.heartbeat_dir, env.me.local_rank
        self.path = Path(where) / contract.SDC_INJECT_FILE.format(local_rank=local_rank) if where else None
        self.result = Path(where) / contract.SDC_RESULT_FILE.format(local_rank=local_rank) if where else None

    def poll(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, where: str) -> None:
        if self.path is None or not os.path.exists(self.path):
            return
        request_id: Any = None
        try:
            request = json.loads(self.path.read_text())
            self.path.unlink()
            request_id = request.get("id")
            what, kind = str(request["what"]), str(request.get("kind", "bit"))
            name, tensor = resolve(module, optimizer, what)
            poison(tensor, kind)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            log.error("%s fault injection request not carried out: %s", where, why)
            self._answer(request_id, False, f"{where} did not carry it out: {why}")
            return
        log.warning("%s fault injection: %s element 0 of %s after step %d (silent data corruption, on request)",
                    where, _done(kind), name, step)
        self._answer(request_id, True, f"{where} {_done(kind)} element 0 of {name} after step {step}")

    def _answer(self, request_id: Any, done: bool, line: str) -> None:
        if request_id is None or self.result is None:  # asked without waiting for an answer (elastic local)
            return
        try:
            write_atomically(self.result, json.dumps({"id": request_id, "done": done, "line": line}).encode())
        except OSError as exc:
            log.warning("could not leave the fault injection's outcome for the agent: %s", exc)


__all__ = ["FIRST", "FlipRequests", "KINDS", "flip_bit", "poison", "request_flip", "resolve", "take_flip_result",
           "target", "tensors_there"]

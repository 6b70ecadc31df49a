"""Chaos commands through etcd: ``elastic kill`` for a node on another machine.

A signed command under ``{run}/commands/{node}`` asks that node's agent to SIGKILL its
own process tree (node loss), to SIGSTOP it for a while (a partition), or to have its
first worker flip one bit of its training state (silent data corruption, ``elastic
inject-sdc``: :mod:`elastic.consistency.inject`; the agent puts what the worker did, or why
not, under ``{run}/sdc-results/{node}`` for the command to print), or to have the job check
its replicas at its next step (``elastic check``: :mod:`elastic.consistency.ondemand`; the
agent puts the outcome under ``{run}/check-results/{node}``). The agent reads it from its
watch-fed mirror in the monitor loop, so it costs nothing when unused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from agent.etcd import EtcdClient
from agent.rendezvous.registry import run_prefix
from agent.rendezvous.signing import SignatureError, StateSigner

from agent.node.proctree import kill_tree, process_tree

if TYPE_CHECKING:
    from agent.rendezvous.session import RendezvousSession

log = logging.getLogger(__name__)

KILL, FREEZE, SDC, CHECK = "kill", "freeze", "sdc", "check"
SDC_KINDS = ("bit", "nan", "inf")  # as elastic.consistency.inject.KINDS (not imported: no torch in the CLI)
MAX_WHAT = 200  # SDC: a tensor's name (a parameter, or <parameter>.<optimizer state>)
MAX_FREEZE_S = 86400.0  # a chaos freeze, not a way to park a node: longer is a typo


def command_key(key_prefix: str, run_id: str, node: str) -> str:
    return f"{run_prefix(key_prefix, run_id)}/commands/{node}"


def check_result_key(key_prefix: str, run_id: str, node: str) -> str:
    """Where a node's agent puts the outcome of the check ``elastic check`` asked of it."""
    return f"{run_prefix(key_prefix, run_id)}/check-results/{node}"


def sdc_result_key(key_prefix: str, run_id: str, node: str) -> str:
    """Where a node's agent puts what its worker did with ``elastic inject-sdc``'s request."""
    return f"{run_prefix(key_prefix, run_id)}/sdc-results/{node}"


def valid_freeze(seconds: object) -> bool:
    """A freeze a thaw can end: finite seconds in (0, MAX_FREEZE_S] (NaN, inf or a negative
    number would leave the node frozen for good)."""
    return (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
            and 0 < seconds <= MAX_FREEZE_S)


@dataclass(frozen=True)
class Command:
    action: str  # KILL, FREEZE, SDC or CHECK
    seconds: float  # FREEZE: how long (valid_freeze)
    issued_at: float  # time.time() of the sender
    what: str = ""  # SDC: the tensor to flip a bit of ("first": the first parameter)
    kind: str = "bit"  # SDC: a flipped bit, or a NaN or an Inf written (elastic.consistency.inject.KINDS)

    def to_json(self) -> bytes:
        body: dict[str, object] = {"action": self.action, "seconds": self.seconds, "issued_at": self.issued_at}
        if self.action == SDC:
            body["what"] = self.what
            if self.kind != "bit":
                body["kind"] = self.kind
        return json.dumps(body).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Command":
        """Raises ValueError on anything that is not a command ``send`` could have written."""
        try:
            data = json.loads(raw)
        except RecursionError:
            raise ValueError("not a command: nested too deeply") from None
        if not isinstance(data, dict):
            raise ValueError("not a command: not a JSON object")
        action, seconds, issued_at = data.get("action"), data.get("seconds", 0.0), data.get("issued_at")
        if action not in (KILL, FREEZE, SDC, CHECK):
            raise ValueError(f"unknown action {action!r:.40}")
        if not (isinstance(issued_at, (int, float)) and not isinstance(issued_at, bool)
                and math.isfinite(issued_at)):
            raise ValueError(f"issued_at {issued_at!r:.40} is not a time")
        if action == FREEZE and not valid_freeze(seconds):
            raise ValueError(f"freeze for {seconds!r:.40} s: not seconds above 0 and at most {MAX_FREEZE_S:g}")
        what = data.get("what", "first") if action == SDC else ""
        if action == SDC and not (isinstance(what, str) and 0 < len(what) <= MAX_WHAT):
            raise ValueError(f"sdc of {what!r:.40}: not a tensor name of 1 to {MAX_WHAT} characters")
        kind = data.get("kind", "bit") if action == SDC else "bit"
        if kind not in SDC_KINDS:
            raise ValueError(f"sdc kind {kind!r:.40}: not one of {', '.join(SDC_KINDS)}")
        return cls(action, float(seconds) if action == FREEZE else 0.0, float(issued_at), what, kind)


def decode_command(signer: StateSigner, key: str, value: bytes) -> Command | None:
    """The command at ``key``, or None (logged) if it is forged or not a command."""
    try:
        return Command.from_json(signer.open(key.encode(), value))
    except (SignatureError, ValueError) as exc:
        log.warning("ignoring a forged or unreadable command at %s: %s", key, exc)
        return None


def send(client: EtcdClient, signer: StateSigner, key_prefix: str, run_id: str, node: str,
         action: str, seconds: float = 0.0, what: str = "", kind: str = "bit") -> float:
    """Put the signed command; returns its ``issued_at`` (``elastic check`` matches its answer by it)."""
    key = command_key(key_prefix, run_id, node)
    if action == FREEZE and not valid_freeze(seconds):
        raise ValueError(f"cannot freeze for {seconds!r} s: give seconds above 0 and at most {MAX_FREEZE_S:g}")
    command = Command(action, float(seconds), time.time(), what, kind)
    body = command.to_json()
    client.call(lambda c: c.put(key, signer.seal(key.encode(), body)))
    return command.issued_at


THAW_MARK = "elastic-thaw"  # in the helper's command line, for ps (and tests)

# The launcher forks the helper, prints its pid and exits; the helper, reparented away
# from the frozen tree, sleeps and then SIGCONTs every pid it was given.
_THAW_HELPER = """\
import os, signal, sys, time
seconds, pids = float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
pid = os.fork()
if pid:
    print(pid, flush=True)
    os._exit(0)
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)  # the launcher's reader waits for the pipe to close
time.sleep(seconds)
for p in pids:
    try:
        os.kill(p, signal.SIGCONT)
    except OSError:
        pass
os._exit(0)
"""


class ThawError(RuntimeError):
    """The thaw helper could not be started, so nothing was frozen."""


def freeze_for(root: int, seconds: float) -> list[int]:
    """SIGSTOP ``root``'s process tree for ``seconds``; returns the pids frozen.

    A detached helper SIGCONTs exactly those pids, also when ``root`` is this process
    (an agent acting on a command from etcd stops itself last). Raises :class:`ThawError`,
    having frozen nothing, if the helper did not start.
    """
    if not valid_freeze(seconds):
        raise ValueError(f"cannot freeze for {seconds!r} s: give seconds above 0 and at most {MAX_FREEZE_S:g}")
    pids = process_tree(root)
    if not pids:
        return []
    helper = _start_thaw_helper(pids, seconds)
    me = os.getpid()
    frozen = [p for p in pids if p not in (helper, me)] + ([me] if me in pids else [])
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    return frozen


def _start_thaw_helper(pids: list[int], seconds: float) -> int:
    """The pid of a running helper that will thaw ``pids`` in ``seconds``; its launcher is
    reaped here before this returns, so the helper is nobody's child in the frozen tree."""
    try:
        done = subprocess.run([sys.executable, "-c", _THAW_HELPER, THAW_MARK, repr(seconds), *map(str, pids)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              start_new_session=True, timeout=30, text=True)
        return int(done.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise ThawError(f"could not start the thaw helper ({exc}); nothing was frozen") from exc


def carry_out(command: Command) -> None:
    """What an agent does with a command meant for it: its own tree, itself last."""
    log.warning("chaos command from etcd: %s this node", command.action)
    if command.action == KILL:
        kill_tree(os.getpid(), signal.SIGKILL)
    elif command.action == FREEZE:
        try:
            freeze_for(os.getpid(), command.seconds)
        except ThawError as exc:
            log.error("not freezing this node: %s", exc)


class CommandWatch:
    def __init__(self, session: "RendezvousSession", node: str) -> None:
        self.session, self.node = session, node
        self.key = command_key(session.key_prefix, session.run_id, node)
        self._started = time.time()
        self.heartbeat_dir: str | None = None  # SDC, CHECK: where the node's first worker looks for a request
        self._asked = False  # a check was asked of a worker: look for its outcome (one stat per poll)
        self._flip_asked = False  # ... a fault injection: the same

    def poll(self) -> None:
        if self._asked:
            self._forward_result()
        if self._flip_asked:
            self._forward_flip_result()
        entry = self.session.entries().get(self.key)
        if entry is None:
            return
        command = decode_command(self.session.signer, self.key, entry.value)
        if command is None or command.issued_at < self._started:
            return  # forged, or meant for an earlier agent of the same name
        self._started = time.time()
        try:
            self.session.delete(self.key, deadline=2.0)
        except Exception:  # noqa: BLE001 - acting matters more than tidying
            pass
        if command.action == SDC:
            if ask_worker_to_flip(self.heartbeat_dir, command.what, command.kind, command.issued_at):
                self._flip_asked = True
            else:
                self._put_result(sdc_result_key, {"id": command.issued_at, "done": False,
                                                  "line": f"node {self.node} runs no workers to corrupt"})
        elif command.action == CHECK:
            self._asked = ask_worker_to_check(self.heartbeat_dir, command.issued_at) or self._asked
        else:
            carry_out(command)

    def _forward_result(self) -> None:
        """The worker's outcome, signed, to etcd (where ``elastic check`` waits for it)."""
        from elastic.consistency.ondemand import take_result

        assert self.heartbeat_dir is not None
        result = take_result(self.heartbeat_dir)
        if result is None:
            return
        self._asked = False
        self._put_result(check_result_key, result)

    def _forward_flip_result(self) -> None:
        """What the worker did with a fault injection (or why not), signed, to etcd."""
        from elastic.consistency.inject import take_flip_result

        assert self.heartbeat_dir is not None
        result = take_flip_result(self.heartbeat_dir)
        if result is None:
            return
        self._flip_asked = False
        self._put_result(sdc_result_key, result)

    def _put_result(self, key_of: Callable[[str, str, str], str], result: dict[str, object]) -> None:
        key = key_of(self.session.key_prefix, self.session.run_id, self.node)
        try:
            self.session.put_signed(key, json.dumps(result).encode(), deadline=2.0)
        except Exception as exc:  # noqa: BLE001 - the job goes on; the command says it got no answer
            log.warning("could not put a command's outcome in etcd at %s: %s", key, exc)


def ask_worker_to_flip(heartbeat_dir: str | None, what: str, kind: str = "bit", request_id: float | None = None) -> bool:
    """Leave the request for local rank 0, which takes it at its next step boundary (and,
    with ``request_id``, leaves its outcome); False if this agent runs no workers."""
    if heartbeat_dir is None:
        log.error("chaos command from etcd: sdc, but this agent runs no workers to corrupt")
        return False
    from elastic.consistency.inject import FIRST, request_flip

    request_flip(heartbeat_dir, 0, what, kind, request_id)
    log.warning("chaos command from etcd: sdc: local rank 0 %s %s at its next step boundary",
                "flips a bit of" if kind == "bit" else f"writes a {'NaN' if kind == 'nan' else 'Inf'} into",
                "its first parameter" if what == FIRST else what)
    return True


def ask_worker_to_check(heartbeat_dir: str | None, request_id: float) -> bool:
    """Leave the request for local rank 0: the world checks its replicas at its next step."""
    if heartbeat_dir is None:
        log.error("command from etcd: check, but this agent runs no workers")
        return False
    from elastic.consistency.ondemand import request_check

    request_check(heartbeat_dir, request_id)
    log.warning("command from etcd: check: the job checks its replicas at its next step")
    return True

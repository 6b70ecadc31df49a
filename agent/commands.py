"""Chaos commands through etcd: ``elastic kill`` for a node on another machine.

A signed command under ``{run}/commands/{node}`` asks that node's agent to SIGKILL its
own process tree (node loss) or to SIGSTOP it for a while (a partition). The agent reads
it from its watch-fed mirror in the monitor loop, so it costs nothing when unused.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from elastic.etcd import EtcdClient
from elastic.rendezvous.registry import run_prefix
from elastic.rendezvous.signing import SignatureError, StateSigner

from .proctree import freeze_tree, kill_tree, process_tree

if TYPE_CHECKING:
    from elastic.rendezvous.handler import EtcdV3RendezvousHandler

log = logging.getLogger(__name__)

KILL, FREEZE = "kill", "freeze"


def command_key(key_prefix: str, run_id: str, node: str) -> str:
    return f"{run_prefix(key_prefix, run_id)}/commands/{node}"


def send(client: EtcdClient, signer: StateSigner, key_prefix: str, run_id: str, node: str,
         action: str, seconds: float = 0.0) -> None:
    key = command_key(key_prefix, run_id, node)
    body = json.dumps({"action": action, "seconds": seconds, "issued_at": time.time()}).encode()
    client.call(lambda c: c.put(key, signer.seal(key.encode(), body)))


class CommandWatch:
    def __init__(self, handler: "EtcdV3RendezvousHandler", node: str) -> None:
        self.handler = handler
        self.key = command_key(handler.options.key_prefix, handler.run_id, node)
        self._started = time.time()

    def poll(self) -> None:
        entries, _ = self.handler.mirror.entries()
        entry = entries.get(self.key)
        if entry is None:
            return
        try:
            command = json.loads(self.handler.signer.open(self.key.encode(), entry.value))
        except (SignatureError, ValueError) as exc:
            log.warning("ignoring a forged or unreadable command at %s: %s", self.key, exc)
            return
        if float(command.get("issued_at", 0)) < self._started:
            return  # meant for an earlier agent of the same name
        self._started = time.time()
        try:
            self.handler.client.call(lambda c: c.delete(self.key), deadline=2.0)
        except Exception:  # noqa: BLE001 - acting matters more than tidying
            pass
        action = command.get("action")
        log.warning("chaos command from etcd: %s this node", action)
        if action == KILL:
            kill_tree(os.getpid(), signal.SIGKILL)
        elif action == FREEZE:
            freeze_for(os.getpid(), float(command.get("seconds") or 10.0))


def freeze_for(root: int, seconds: float) -> None:
    """SIGSTOP the tree, with a detached process that SIGCONTs it after ``seconds``."""
    pids = process_tree(root)
    thaw = (f"import os,signal,time; time.sleep({seconds!r})\n"
            f"for p in {pids!r}:\n    try: os.kill(p, signal.SIGCONT)\n    except OSError: pass")
    subprocess.Popen([sys.executable, "-c", thaw], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    freeze_tree(root)

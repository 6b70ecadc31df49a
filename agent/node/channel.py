"""The agent's end of the in-place channel to its workers (:mod:`elastic.inplace.channel`).

It runs in the agent, so it lives here; the wire format both ends share (``RoundOffer``,
``WorkerStatus``, the file names in :mod:`elastic.contract`) stays with the worker's end in
``elastic/``, which the workers import without the agent.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from elastic import contract
from elastic.atomic_file import write_atomically
from elastic.inplace.channel import RoundOffer, WorkerStatus


class AgentChannel:
    """The agent's end: it writes offers, reads statuses and waits on the wake FIFO."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        fifo = directory / contract.WAKE_FIFO
        if not fifo.exists():
            os.mkfifo(fifo, 0o600)
        # read-write and non-blocking: never blocks on open, never sees EOF when writers go
        self.wake_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)

    def offer(self, offer: RoundOffer) -> None:
        write_atomically(self.directory / contract.OFFER_FILE, offer.to_json())

    def withdraw(self) -> None:
        """No round for the workers: a restart path's new workers must not read an old offer."""
        with contextlib.suppress(FileNotFoundError):
            (self.directory / contract.OFFER_FILE).unlink()

    def status(self, local_rank: int) -> WorkerStatus | None:
        try:
            return WorkerStatus.from_json((self.directory / contract.worker_status_file(local_rank)).read_bytes())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def forget(self, local_rank: int) -> None:
        """A worker was replaced: its predecessor's status must not speak for it."""
        with contextlib.suppress(FileNotFoundError):
            (self.directory / contract.worker_status_file(local_rank)).unlink()

    def drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_fd, 4096):
                pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.wake_fd)

"""Counts the processes a test starts, for ``make test-profile`` (tests/support/profile_plugin.py).

``make test-profile`` installs a ``.pth`` line into the venv that imports this module at every
interpreter start. With ``ELASTIC_PROFILE_LOG`` unset it does nothing; set, it appends one line
per event to that file, tagged with the test that started the process (``ELASTIC_PROFILE_TEST``,
inherited from the pytest worker): ``start`` for an interpreter start, ``fork`` for a forked
child (the agents' warm templates fork workers), ``torch`` for a process's first ``import
torch``. A forked child that inherits torch does not log ``torch``: that is the cost saved.

Standalone on purpose (no project imports): it runs before anything else in every process.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from typing import Any, Sequence

LOG_ENV = "ELASTIC_PROFILE_LOG"
TEST_ENV = "ELASTIC_PROFILE_TEST"


def _command() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200].replace("\t", " ").replace("\n", " ")
    except OSError:
        return "?"


def _log(event: str) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = f"{event}\t{os.getpid()}\t{os.environ.get(TEST_ENV, '-')}\t{_command()}\n".encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write under O_APPEND: lines from many processes never interleave
        finally:
            os.close(fd)
    except OSError:
        pass


class _TorchImport(MetaPathFinder):
    """Logs the first ``import torch`` of this interpreter, then steps aside."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> None:
        if fullname == "torch":
            _log("torch")
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        return None


def install() -> None:
    if not os.environ.get(LOG_ENV):
        return
    _log("start")
    if "torch" not in sys.modules:
        sys.meta_path.insert(0, _TorchImport())
    os.register_at_fork(after_in_child=_forked)


def _forked() -> None:
    """A fork of the agents' zygote (agent/local/zygote.py) logs itself once it has taken its
    requester's environment, which names the test; here it would name the zygote's first."""
    if "agent.local.zygote" not in _command():
        _log("fork")


install()

"""A test's own Python processes (a rank of a job run without an agent, a user's script), forked
from the pytest worker's pre-imported zygote (:mod:`agent.local.zygote`) instead of started by
exec: the same ``sys.argv``, ``sys.path[0]``, environment, working directory and ``__main__``
as ``python SCRIPT ...`` or ``python -m MODULE ...``, without an import of torch per process.
Output goes to a file. ``ELASTIC_TEST_EXEC_AGENTS=1`` starts them by exec instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from agent.local.zygote import ForkedProcess, ZygoteGone
from tests.support.nodes import shared_zygote

Process = subprocess.Popen[bytes] | ForkedProcess


def python(args: Sequence[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Process:
    """``python *args`` (a script's path, or ``-m MODULE``, then its arguments) with stdout and
    stderr appended to ``log``."""
    env = dict(os.environ if env is None else env)
    cwd = cwd or Path.cwd()
    zygote = shared_zygote()
    if zygote is not None:
        kind, target, rest = ("module", args[1], args[2:]) if args[0] == "-m" else ("script", args[0], args[1:])
        try:
            return zygote.fork(target, list(rest), env, cwd, log, kind=kind)
        except ZygoteGone:
            pass
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=cwd)

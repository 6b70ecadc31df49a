"""A test's own Python processes (a rank of a job run without an agent, a user's script), forked
from the pytest worker's pre-imported zygote (:mod:`agent.local.zygote`) instead of started by
exec: the same ``sys.argv``, ``sys.path[0]``, environment, working directory and ``__main__``
as ``python SCRIPT ...`` or ``python -m MODULE ...``, without an import of torch per process.
Output goes to a file. ``ELASTIC_TEST_EXEC_AGENTS=1`` starts them by exec instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

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
            # its snapshot writer forked ahead, as under an agent's warm worker: an exec'd writer's
            # torch import per rank 0 (the exec path has tests of its own: tests/checkpoints)
            return zygote.fork(target, list(rest), env, cwd, log, kind=kind, writer_stub=True)
        except ZygoteGone:
            pass
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=cwd)


def ranks(fn: Callable[..., None], args: Sequence[Any], nprocs: int, log_dir: Path, timeout: float = 300.0) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)`` with each rank forked from the
    zygote by :func:`python`: ``fn(rank, *args)`` in ``nprocs`` processes, ``fn`` a module-level
    function and ``args`` JSON values. mp.spawn's ranks each imported torch (2-3 s of CPU on a
    loaded machine). A rank that fails stops the others, and its log is in the error, as
    mp.spawn raises the failed rank's exception; each rank's output is ``log_dir/rank-N.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    target = f"{fn.__module__}:{fn.__qualname__}"
    started = [python(["-m", "tests.support.rank_main", target, str(rank), json.dumps(list(args))],
                      log_dir / f"rank-{rank}.log") for rank in range(nprocs)]
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in started]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank = failed[0]
                tail = (log_dir / f"rank-{rank}.log").read_text(errors="replace")[-4000:]
                raise AssertionError(f"rank {rank} of {target} exited {codes[rank]}:\n{tail}")
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{target}: ranks still running after {timeout:g} s (exit codes {codes})")
            time.sleep(0.05)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait(10)

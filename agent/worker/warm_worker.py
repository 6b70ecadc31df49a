"""A standby worker: a Python process that has already imported torch, waiting for its rank.

Started by :class:`agent.node.warm_start.WarmPool` (``STANDBY_CODE``). Importing torch (and
``torch._dynamo``, which the first ``Optimizer.step`` pulls in) costs 2-5 s of CPU, and
after a node loss that cost would sit on the critical path of every restarted worker. A
standby pays it while the world is healthy; when the agent starts a worker it sends the
standby one JSON line (argv, environment, log files) and the standby *becomes* the
worker: same pid, own session, the torchrun environment, the target run through
:mod:`agent.worker.worker_boot` exactly as a cold worker runs it.

Why this is safe: the standby starts with the agent's environment, the base torchrun
builds each worker's environment on. What differs (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*,
TORCHELASTIC_*, ELASTIC_ROUND, CUDA_VISIBLE_DEVICES) is read by torch only when a process
group or the CUDA context is created, never at import, and CUDA is not initialised here.
OMP_NUM_THREADS is re-applied in case it changed. Nothing is forked.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import shlex
import sys
import time
from typing import Any, cast

from checkpoints import procstub
from elastic import contract

from agent.worker import worker_boot
from agent.worker.gc_frozen import freeze_preloaded

DEFAULT_IMPORTS = ("torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch._dynamo",
                   "elastic.trainer")
STANDBY_CODE = "import sys; sys.path.pop(0); from agent.worker.warm_worker import main; main()"


def preload_configured() -> None:
    """What ``ELASTIC_WARM_IMPORTS`` names, or :data:`DEFAULT_IMPORTS` (standby and template),
    frozen out of later collections (:mod:`agent.worker.gc_frozen`)."""
    modules = os.environ.get(contract.WARM_IMPORTS_ENV)
    preload(modules.split(",") if modules else list(DEFAULT_IMPORTS))
    freeze_preloaded()


def preload(modules: list[str]) -> None:
    """Import what every worker imports; a module that is missing or fails is skipped
    (the worker imports it again and reports the error itself, with its own traceback)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the real worker will raise it properly
            pass


def become(spec: dict[str, Any], parent_pid: int | None = None) -> None:
    """Turn this process into the worker ``spec`` describes, then run it to the end.
    ``parent_pid``: the process whose death must kill this worker, when not the agent."""
    os.environ.clear()
    os.environ.update(spec["env"])
    # What a cold start's process start time means: when the agent gave this standby its
    # rank, even if the standby was still importing then (it reads its rank only after).
    os.environ[contract.WORKER_STARTED_AT_ENV] = repr(float(spec.get("given_at") or time.time()))
    _redirect(0, os.devnull, os.O_RDONLY)
    if spec.get("stdout"):
        _redirect(1, spec["stdout"], os.O_WRONLY | os.O_TRUNC | os.O_CREAT)
    if spec.get("stderr"):
        _redirect(2, spec["stderr"], os.O_WRONLY | os.O_TRUNC | os.O_CREAT)
    # python -u, as every agent worker runs (a started interpreter's streams are TextIOWrappers)
    cast(io.TextIOWrapper, sys.stdout).reconfigure(write_through=True)
    cast(io.TextIOWrapper, sys.stderr).reconfigure(write_through=True)
    _show_as_worker(spec)
    _apply_thread_count()
    worker_boot.prepare(parent_pid)
    procstub.prefork()  # one thread still: the snapshot writer forked now costs a fork, not an import
    worker_boot.run(spec)


exit_now = worker_boot.exit_now  # kept for callers of the old name


def _redirect(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def title_ready() -> None:
    """setproctitle finds the memory it rewrites (argv's, then environ's) at its first call,
    and finds none once the environment has been cleared: call it first thing."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.getproctitle()


def _show_as_worker(spec: dict[str, Any]) -> None:
    """What ``ps`` shows: the command a cold worker runs, not the standby's or the agent's
    (a forked template's children inherit its command line)."""
    try:
        import setproctitle
    except ImportError:
        return
    target = ["-m", spec["module"]] if spec.get("module") else [spec["script"]]
    setproctitle.setproctitle(shlex.join([sys.executable, "-u", *target, *spec["args"]]))


def _apply_thread_count() -> None:
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0 and "torch" in sys.modules:
        import torch

        torch.set_num_threads(int(value))


def main() -> None:
    title_ready()
    worker_boot.die_with_agent()
    preload_configured()
    ready_fd = os.environ.pop(contract.STANDBY_READY_FD_ENV, "")
    if ready_fd.isdigit():  # tell the pool the imports are done (one byte, then EOF)
        with contextlib.suppress(OSError):
            os.write(int(ready_fd), b"r")
            os.close(int(ready_fd))
    line = sys.stdin.buffer.readline()
    if not line:  # the agent went away (or shut its pool down) before needing us
        sys.exit(0)
    become(json.loads(line))

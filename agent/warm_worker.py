"""A standby worker: a Python process that has already imported torch, waiting for its rank.

Run as ``python -m agent.warm_worker`` by :class:`agent.warm_start.WarmPool`. Importing
torch (and ``torch._dynamo``, which the first ``Optimizer.step`` pulls in) costs 2-5 s
of CPU, and after a node loss that cost sits on the critical path of every survivor's
recovery. A standby pays it while the world is still healthy; when the agent starts its
next worker group it sends the standby one JSON line (argv, environment, log files) and
the standby *becomes* the worker: same pid, own session, the torchrun environment, the
script run as ``__main__``.

Why this is safe: the standby starts with the agent's environment, which is the base
that torchrun's per-worker environment is built on. What differs (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_*, TORCHELASTIC_*, ELASTIC_ROUND, CUDA_VISIBLE_DEVICES) is read by
torch only when a process group or the CUDA context is created, never at import, and
CUDA is not initialised here. OMP_NUM_THREADS is re-applied in case it changed.
Nothing is forked: the worker is a fresh process that merely started early.

A worker that fails exits at once (:func:`exit_now`): after a peer dies, tearing down
gloo's process group in the interpreter's finalisation takes the survivor 1-3 s more,
spent before its agent can even notice the failure.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import sys
import time
import traceback
from typing import Any

from elastic.metrics.worker import STARTED_AT_ENV

WARM_IMPORTS_ENV = "ELASTIC_WARM_IMPORTS"
READY_FD_ENV = "ELASTIC_STANDBY_READY_FD"
DEFAULT_IMPORTS = ("torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch._dynamo",
                   "elastic.trainer")


def preload(modules: list[str]) -> None:
    """Import what every worker imports; a module that is missing or fails is skipped
    (the worker imports it again and reports the error itself, with its own traceback)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the real worker will raise it properly
            pass


def become(spec: dict[str, Any]) -> None:
    """Turn this process into the worker ``spec`` describes, then run it to the end."""
    os.environ.clear()
    os.environ.update(spec["env"])
    os.environ[STARTED_AT_ENV] = repr(time.time())  # what a cold start's process start time means
    _redirect(0, os.devnull, os.O_RDONLY)
    if spec.get("stdout"):
        _redirect(1, spec["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    if spec.get("stderr"):
        _redirect(2, spec["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    if spec.get("unbuffered"):
        sys.stdout.reconfigure(write_through=True)  # python -u
        sys.stderr.reconfigure(write_through=True)
    _apply_thread_count()
    try:
        _run(spec)
    except SystemExit as done:
        if done.code in (None, 0):
            raise  # success: the interpreter's normal, thorough shutdown
        if not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
        exit_now(done.code if isinstance(done.code, int) else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter would report it, then out
        traceback.print_exc()
        exit_now(1)


def exit_now(code: int) -> None:
    """Exit a failed worker without the C++ teardown, keeping what Python promises:
    atexit handlers (the snapshot writer flushes there) and flushed stdio."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run(spec: dict[str, Any]) -> None:
    if spec.get("module"):
        sys.argv = [spec["module"], *spec["args"]]
        sys.path[0] = os.getcwd()  # as `python -m` does
        runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
    else:
        script = spec["script"]
        sys.argv = [script, *spec["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` does
        runpy.run_path(script, run_name="__main__")


def _redirect(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def _apply_thread_count() -> None:
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0 and "torch" in sys.modules:
        import torch

        torch.set_num_threads(int(value))


def main() -> None:
    modules = os.environ.get(WARM_IMPORTS_ENV)
    preload(modules.split(",") if modules else list(DEFAULT_IMPORTS))
    ready_fd = os.environ.pop(READY_FD_ENV, "")
    if ready_fd.isdigit():  # tell the pool the imports are done (one byte, then EOF)
        with contextlib.suppress(OSError):
            os.write(int(ready_fd), b"r")
            os.close(int(ready_fd))
    line = sys.stdin.buffer.readline()
    if not line:  # the agent went away (or shut its pool down) before needing us
        sys.exit(0)
    become(json.loads(line))


if __name__ == "__main__":
    main()

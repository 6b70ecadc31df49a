"""Local nodes' agents forked from one pre-imported process, not each started by exec.

On a real machine an agent starts once and its import of torch (2-3 s of CPU, seconds of wall
on a loaded machine) is paid once per node. A one-machine cluster (``elastic local``, the test
suite) starts many agents on the same cores, again after every simulated node loss, and each
paid that import: the largest part of what a multi-node test cost. A :class:`Zygote` imports
torch and the agent's start-up once; every local node's agent is then a fork of it that runs
``elastic agent`` exactly as the command would (``agent.cli.main`` with the node's argv,
environment, working directory and log), in a session of its own. The agent forks its own
worker template from itself as usual (``agent.node.fork_server.fork_early``), so the whole node
shares the one import.

What differs from an exec'd agent, and why that is safe here (the same reasoning as the worker
template's, :mod:`agent.worker.fork_template`): the zygote imported torch under the cluster's
environment, not the node's. Nothing it imports reads the node's settings at import time: it
does not import ``prometheus_client`` (which fixes its multiprocess mode at import) or the
agent's launcher, and it checks, before it says ``ready``, that it runs no second thread and
has not loaded the CUDA driver. Nodes in a network namespace, plain ``torchrun``, and the
tests of the command itself still start by exec.

Protocol (one JSON request per line on the zygote's stdin; replies on its stdout): ``ready`` or
``unsafe REASON`` once; ``started ID PID`` for each fork; ``exited PID CODE`` when an agent ends
(``Popen.returncode``'s meaning). The zygote reaps its children, so a :class:`ForkedProcess` learns
its exit code from it. The zygote ends when its stdin closes (the cluster's process went away).
"""

from __future__ import annotations

import atexit
import importlib
import json
import runpy
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from checkpoints.pids import pid_alive

ZYGOTE_CODE = "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; " \
              "from agent.local.zygote import serve; serve()"
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch._dynamo")
START_TIMEOUT_S = 120.0  # an import of torch on a loaded 2-core machine; never a wait in a healthy run
REPLY_TIMEOUT_S = 10.0  # a fork takes milliseconds


# Read by the dynamic loader or the interpreter when a process starts: a fork cannot honour a
# value the zygote did not start with (libfaketime's LD_PRELOAD, a PYTHONHASHSEED...), so such a
# process is started by exec. PYTHONPATH is honoured by adding its entries to sys.path, unless an
# entry brings a sitecustomize or usercustomize, which only a start runs.
_EXEC_TIME = ("LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "FAKETIME", "PYTHONHOME", "PYTHONHASHSEED",
              "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE", "PYTHONMALLOC", "PYTHONDEVMODE", "PYTHONUTF8",
              "PYTHONWARNINGS", "PYTHONSTARTUP", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONPLATLIBDIR",
              "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC", "PYTHONIOENCODING", "PYTHONLEGACYWINDOWSSTDIO")


class ZygoteGone(RuntimeError):
    """The zygote is not there to fork (it said unsafe, died, or never answered), or cannot
    start this process as an exec would (:data:`_EXEC_TIME`)."""


def exec_only_reason(env: dict[str, str], started_with: dict[str, str]) -> str:
    """Why a process with ``env`` must be started by exec, not forked from a zygote started with
    ``started_with``; '' if a fork gives it what an exec would."""
    for name in _EXEC_TIME:
        if env.get(name) != started_with.get(name):
            return f"{name} differs from the zygote's"
    for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
        for hook in ("sitecustomize.py", "usercustomize.py"):
            if os.path.exists(os.path.join(entry, hook)) and entry not in started_with.get("PYTHONPATH", ""):
                return f"PYTHONPATH brings {os.path.join(entry, hook)}, which only a start runs"
    return ""


class Zygote:
    """The cluster's side: one pre-imported process that forks agents on request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = iter(range(1 << 62))
        self._exits: dict[int, int] = {}
        self._pending = b""
        self._replies: list[str] = []
        self._process: subprocess.Popen[bytes] | None = None
        self._broken = ""
        self._started_with: dict[str, str] = {}

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self._broken:
            raise ZygoteGone(self._broken)
        if self._process is not None and self._process.poll() is None:
            return self._process
        if self._process is not None:
            self._broken = f"the agent zygote exited ({self._process.returncode})"
            raise ZygoteGone(self._broken)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._started_with = env
        self._process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE_CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        assert self._process.stdout is not None
        os.set_blocking(self._process.stdout.fileno(), False)
        atexit.register(self.close)
        first = self._line(START_TIMEOUT_S)
        if first != "ready":
            self._broken = f"the agent zygote said {first!r}"
            self.close()
            raise ZygoteGone(self._broken)
        return self._process

    def _read(self, timeout: float) -> None:
        """Wait up to ``timeout`` for replies; record exits, queue the rest."""
        assert self._process is not None and self._process.stdout is not None
        fd = self._process.stdout.fileno()
        readable, _, _ = select.select([fd], [], [], max(0.0, timeout))
        if readable:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                data = b"-"
            if not data:
                self._broken = self._broken or "the agent zygote closed its replies"
            elif data != b"-":
                self._pending += data
        while b"\n" in self._pending:
            raw, self._pending = self._pending.split(b"\n", 1)
            line = raw.decode()
            if line.startswith("exited "):
                _, pid, code = line.split()
                self._exits[int(pid)] = int(code)
            else:
                if line.startswith("started "):
                    # A new child under a pid an earlier child had (the kernel reuses pids: pid_max
                    # 32768, a pid per thread): that one's exit is not this one's. In stream order,
                    # so an exit of the new child read in the same batch is kept.
                    self._exits.pop(int(line.split()[2]), None)
                self._replies.append(line)

    def _line(self, timeout: float) -> str:
        """The next reply other than an exit."""
        deadline = time.monotonic() + timeout
        while not self._replies:
            left = deadline - time.monotonic()
            if left <= 0 or self._broken:
                return self._broken or "no answer"
            self._read(left)
        return self._replies.pop(0)

    def fork(self, module: str, argv: Sequence[str], env: dict[str, str], cwd: Path, log: Path,
             kind: str = "main", writer_stub: bool = False) -> "ForkedProcess":
        """A process that runs, as ``python`` would: ``module.main(argv)`` (``kind="main"``: ``agent.cli``
        with ``["agent", ...]`` for an agent), ``python -m module *argv`` (``"module"``), or
        ``python module *argv`` where ``module`` is a script's path (``"script"``). Its stdout and
        stderr go to ``log``. ``writer_stub``: fork its snapshot writer ahead first, as a warm worker
        does (:func:`checkpoints.procstub.prefork`). Raises :class:`ZygoteGone` where it cannot fork:
        the caller then starts the process by exec."""
        with self._lock:
            process = self._ensure()
            assert process.stdin is not None
            why = exec_only_reason(env, self._started_with)
            if why:
                raise ZygoteGone(why)  # this one only: the zygote serves the next
            open(log, "ab").close()  # there as soon as we return, as an exec'd process's redirected log is
            request = {"id": next(self._ids), "kind": kind, "module": module, "argv": list(argv), "env": env,
                       "cwd": str(cwd), "log": str(log), "cgroup": _cpuacct_procs(os.getpid()),
                       "writer_stub": writer_stub}
            try:
                process.stdin.write(json.dumps(request).encode() + b"\n")
                process.stdin.flush()
            except OSError as e:
                self._broken = f"the agent zygote's requests failed: {e}"
                raise ZygoteGone(self._broken) from e
            reply = self._line(REPLY_TIMEOUT_S)
            parts = reply.split()
            if len(parts) != 3 or parts[0] != "started" or parts[1] != str(request["id"]):
                self._broken = f"the agent zygote answered {reply!r}"
                raise ZygoteGone(self._broken)
            return ForkedProcess(int(parts[2]), self, [sys.executable, module, *argv])

    def exit_code(self, pid: int, timeout: float = 0.0) -> int | None:
        """``pid``'s exit code once the zygote reaped it, waiting up to ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits and self._process is not None and not self._broken:
                self._read(deadline - time.monotonic())
                if time.monotonic() >= deadline:
                    break
            if pid in self._exits:
                return self._exits[pid]
            if (self._broken or self._process is None) and not pid_alive(pid):
                return -signal.SIGKILL  # its reaper is gone: it ended, its code went with it
            return None

    def close(self) -> None:
        process, self._process = self._process, None
        self._broken = self._broken or "closed"  # no new zygote after this: callers start by exec
        if process is None:
            return
        try:
            if process.stdin is not None:
                process.stdin.close()
            process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()


def _cpuacct_procs(pid: int) -> str | None:
    """The ``cgroup.procs`` of ``pid``'s CPU-accounting group (cgroup v1), if it has one: a forked
    agent joins its requester's, so its CPU is charged where an exec'd agent's would be."""
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpuacct" in controllers.split(","):
                return f"/sys/fs/cgroup/cpuacct{path.rstrip('/')}/cgroup.procs"
    except (OSError, ValueError):
        pass
    return None


def _join_cgroup(procs: str | None) -> None:
    if procs and procs != _cpuacct_procs(os.getpid()):
        try:
            Path(procs).write_text(str(os.getpid()))
        except OSError:
            pass  # not root, or no such group: accounting only


class ForkedProcess:
    """What :class:`agent.local.local_node.LocalNode` (and a test) needs of a ``Popen``, for a
    process forked by the zygote."""

    def __init__(self, pid: int, zygote: Zygote, args: list[str]) -> None:
        self.pid = pid
        self._zygote = zygote
        self.returncode: int | None = None
        self.args = args

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = self._zygote.exit_code(self.pid, min(0.5, left) if left is not None else 0.5)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # poll first: the zygote reaps its children at once, so once this one has ended its pid
        # is free for the kernel to give to another process, which a signal must not reach
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ------------------------------------------------------------------ the zygote process itself


def serve() -> None:
    """The zygote: import what every agent imports, say ``ready``, fork on request."""
    from agent.worker.worker_boot import die_with_agent
    from agent.worker.fork_template import fork_unsafe_reason, reap_children
    from agent.worker.warm_worker import title_ready

    title_ready()  # before anything changes the environment: each agent's title is written over it
    die_with_agent(os.getppid())  # never outlive the cluster that started us
    # What every agent, its worker template and a training script import (the template's own
    # list, agent.worker.warm_worker.DEFAULT_IMPORTS, but for the trainer, which imports
    # prometheus_client): torch._dynamo alone is 3-5 s of CPU, paid at a script's first optimizer.
    for name in PRELOAD:
        importlib.import_module(name)
    import agent.node.fork_server  # noqa: F401 - the agent's first step (fork_early) and its template
    from agent.worker.gc_frozen import freeze_preloaded

    out = sys.stdout.buffer
    unsafe = fork_unsafe_reason() or ("prometheus_client is imported (it fixes its mode from the environment at "
                                      "import)" if "prometheus_client" in sys.modules else "")
    if unsafe:
        out.write(f"unsafe {unsafe}\n".encode())
        out.flush()
        return
    freeze_preloaded()  # every agent forked from here collects (and exits) without walking torch
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    reply_fd = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake select
    signal.set_wakeup_fd(wake_w)
    _say(reply_fd, "ready")
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        reap_children(reply_fd)
        if 0 in readable:
            data = os.read(0, 1 << 16)
            if not data:
                os._exit(0)  # the cluster is gone; its agents live on, each in its own session
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(request, (reply_fd, wake_r, wake_w))
                _say(reply_fd, f"started {request['id']} {pid}")


def _become(request: dict[str, Any], fds: tuple[int, ...]) -> None:
    """In the child: become ``elastic <argv>`` as its command line would start it."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in fds:
            os.close(fd)
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for entry in reversed([e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]):
            if entry not in sys.path:
                sys.path.insert(0, entry)  # the _run below puts argv[0]'s directory in front, as a start does
        _join_cgroup(request.get("cgroup"))
        probe = sys.modules.get("_elastic_proc_probe")  # `make test-profile`'s counter, where installed
        if probe is not None:
            probe._log("fork")
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # fresh entropy, as a new process would take
        if request.get("writer_stub"):
            from checkpoints import procstub

            procstub.prefork()  # still one thread here, as in a warm worker just before its script
        code = _run(request["kind"], request["module"], request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the agent's own crash, printed to its log as an exec'd one would
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed log must not turn into a second error
        pass
    sys.exit(code)  # the interpreter's shutdown and atexit, as for the command


def _run(kind: str, module: str, argv: list[str]) -> int:
    """Run the request's target with the ``sys.argv`` and ``sys.path[0]`` its command line gives."""
    if kind == "main":
        sys.argv = ["-c", *argv]
        _show_as(["-m", module, *argv])
        code = importlib.import_module(module).main(argv)
        return code if isinstance(code, int) else 0
    if kind == "module":
        sys.argv = [module, *argv]  # runpy puts the module's path in argv[0], as -m does
        sys.path.insert(0, os.getcwd())
        _show_as(["-m", module, *argv])
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    if kind == "script":
        sys.argv = [module, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
        _show_as([module, *argv])
        runpy.run_path(module, run_name="__main__")
        return 0
    raise ValueError(f"unknown kind of zygote request {kind!r}")


def _show_as(args: list[str]) -> None:
    """What ``ps`` (and ``elastic kill``'s check of its target) shows: the agent's own command line,
    not the zygote's."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(shlex.join([sys.executable, *args]))


def _say(fd: int, line: str) -> None:
    os.write(fd, line.encode() + b"\n")

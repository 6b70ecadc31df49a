"""The first code every Python worker of ``elastic agent`` runs, warm or cold.

torchrun starts a worker as ``python -u [-m] TARGET ARGS``. The agent starts it as
``python -u -c BOOT [-m] TARGET ARGS``, where ``BOOT`` prepares the process and then runs
``TARGET`` exactly as ``python`` would have (``__main__``, ``sys.argv``, ``sys.path[0]``),
so that any script gets, without a line changed:

* **progress for the hang watchdog**: torch's global optimizer step hook beats the
  heartbeat (:mod:`elastic.progress`);
* **stacks on demand**: ``faulthandler`` dumps every thread on SIGUSR1, which the
  watchdog sends before it restarts a hung worker;
* **death with its agent**: ``PR_SET_PDEATHSIG`` kills the worker if the agent dies. An
  agent is its node; a worker outliving it would hold a GPU and a place in a process
  group that its peers have written off;
* **the library's lines**: the ``elastic`` logger prints at INFO even if the script sets up
  no logging, and never twice if it does (:mod:`elastic.log`);
* **why it failed**: an uncaught exception's last line goes to torchrun's error file
  (:func:`record_error`), where the agent reads it;
* **done is not hung**: once the script returns, its heartbeat says so
  (:func:`elastic.heartbeat.mark_finished`), and the watchdog leaves the interpreter's
  teardown and the script's exit hooks alone, however long they take.

``-c`` rather than ``-m agent.worker.worker_boot`` because ``-m`` puts the working directory
first on ``sys.path`` while our modules import, and a user's own ``agent/`` or ``elastic/``
directory would shadow ours. ``BOOT`` drops that entry and puts back the one the target
expects.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import os
import runpy
import signal
import sys
import traceback
from typing import Any, Sequence

from elastic import contract, failure_record, worker_env
from elastic.heartbeat import mark_finished

BOOT_CODE = "import sys; sys.path.pop(0); from agent.worker.worker_boot import main; main()"
_PR_SET_PDEATHSIG = 1


def boot_command(python: str, target: str, args: Sequence[str], module: bool) -> tuple[str, ...]:
    """The command that runs ``target`` (a script, or a module with ``module``) through BOOT."""
    return (python, "-u", "-c", BOOT_CODE, *(("-m",) if module else ()), target, *args)


def parse_boot_command(command: Sequence[str]) -> dict[str, Any] | None:
    """``boot_command``'s parts back (what a standby needs), or None for anything else."""
    parts = list(command)
    if len(parts) < 5 or parts[1:4] != ["-u", "-c", BOOT_CODE]:
        return None
    if os.path.realpath(parts[0]) != os.path.realpath(sys.executable):
        return None  # another interpreter: a standby of ours cannot become it
    return parse_target(parts[4:])


def parse_target(argv: Sequence[str]) -> dict[str, Any] | None:
    rest = list(argv)
    if not rest:
        return None
    if rest[0] == "-m":
        return {"module": rest[1], "args": rest[2:]} if len(rest) >= 2 else None
    return {"script": rest[0], "args": rest[1:]}


def die_with_agent(parent_pid: int | None = None) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has. The parent is
    the agent (``contract.AGENT_PID_ENV``), or for a worker forked by the node's template
    (:mod:`agent.worker.fork_template`) the template, which itself dies with the agent."""
    expected = parent_pid if parent_pid is not None else worker_env.read().node.agent_pid
    if expected is None or expected < 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: the agent's own clean-up still stops us
    if os.getppid() != expected:
        os._exit(contract.EXIT_FAILED)  # the agent died before the signal was armed


def prepare(parent_pid: int | None = None) -> None:
    die_with_agent(parent_pid)
    from elastic.log import show_library_lines

    show_library_lines()  # the library's lines reach the console even if the script sets up no logging
    if not faulthandler.is_enabled():
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (ValueError, RuntimeError, AttributeError):
            pass
    from elastic.progress import install_optimizer_hook

    install_optimizer_hook()


def run(spec: dict[str, Any]) -> None:
    """Run the target as ``__main__``; a failed worker exits without the C++ teardown."""
    try:
        if spec.get("module"):
            sys.argv = [spec["module"], *spec["args"]]
            sys.path.insert(0, os.getcwd())  # as `python -m` does
            runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
        else:
            script = spec["script"]
            sys.argv = [script, *spec["args"]]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code in (None, 0):
            mark_finished()
            raise  # success: the interpreter's normal, thorough shutdown
        if not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
        exit_now(done.code if isinstance(done.code, int) else 1)
    except BaseException as exc:  # noqa: BLE001 - as the interpreter would report it, then out
        if not _told_lost_peer(exc):
            traceback.print_exc()
        record_error(exc)
        exit_now(contract.EXIT_FAILED)
    mark_finished()


def _told_lost_peer(exc: BaseException) -> bool:
    """A sharded run's lost peer, raised in the script's own backward, said in one line instead
    of a traceback (:func:`elastic.sharded.told_lost_peer`)."""
    sharded = sys.modules.get("elastic.sharded")
    return sharded is not None and bool(sharded.told_lost_peer(exc))


def record_error(exc: BaseException) -> None:
    """The traceback's last line and the error's kind, in torchrun's error file
    (:mod:`elastic.failure_record`), so the agent can name why a worker failed and tell a
    broken world from the script's own error (``agent.node.policy``) by the kind, not the
    words. A file the script's own ``@record`` already wrote keeps its words and gains the kind."""
    failure_record.record(exc)


def exit_now(code: int) -> None:
    """Exit a failed worker without the C++ teardown, keeping what Python promises:
    atexit handlers (the snapshot writer flushes there) and flushed stdio. After a peer
    dies, gloo's teardown holds a survivor 1-3 s more before its agent can even notice."""
    if "elastic.inplace.reconfigure" in sys.modules:  # its exit hook would do that teardown
        sys.modules["elastic.inplace.reconfigure"].skip_leave_at_exit()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main() -> None:
    spec = parse_target(sys.argv[1:])
    if spec is None:
        print("usage: python -c BOOT [-m] TARGET [ARGS...] (started by elastic agent)", file=sys.stderr)
        sys.exit(contract.USAGE_ERROR_EXIT)
    prepare()
    run(spec)

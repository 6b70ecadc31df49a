"""What ``elastic agent`` checks about the training target before any worker starts.

A script that is not there (or cannot be read) fails the same way at every start: torchrun
would start it, print a traceback, restart it ``--max-restarts`` times and exit 1. Checked
here, it is one line and exit 2 (a usage error, which nobody restarts).

Only what is certain to fail in the worker too is refused. The worker runs with this
agent's interpreter, environment and working directory, so a path is judged here as it
will be there. A module (``-m``) is looked up by its top-level package only: finding
``pkg`` needs no import, while finding ``pkg.train`` would import ``pkg`` (running its
code in the agent); a missing submodule is left to the worker to report.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys


def target_problem(target: str, *, module: bool, no_python: bool, cwd: str | None = None) -> str | None:
    """One line saying why ``target`` cannot start, or None when it may."""
    cwd = cwd or os.getcwd()
    if no_python and module:
        return None  # torchrun refuses the pair itself, naming both flags
    if no_python:
        return _executable_problem(target, cwd)
    if module:
        return _module_problem(target, cwd)
    return _script_problem(target, cwd)


def _script_problem(script: str, cwd: str) -> str | None:
    path = os.path.join(cwd, script)
    shown = script if os.path.isabs(script) else f"{script} (in {cwd})"
    if not os.path.exists(path):
        return (f"training script {shown}: no such file; give the path of your script, absolute or relative to "
                "the directory the agent runs in")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "__main__.py")):
            return None  # `python DIR` runs DIR/__main__.py
        return f"training script {shown} is a directory with no __main__.py; give the script inside it"
    if not os.access(path, os.R_OK):
        return (f"training script {shown} is not readable by this user (uid {os.getuid()}); make it readable "
                "(chmod a+r) or run the agent as a user who can read it")
    return None


def _module_problem(name: str, cwd: str) -> str | None:
    top = name.split(".")[0]
    if not top or not top.isidentifier():
        return f"-m {name}: not a module name; give a dotted Python module name, e.g. -m mypackage.train"
    saved = list(sys.path)
    sys.path[:] = [cwd, *(p for p in sys.path[1:])]  # as `python -m` sees it in the worker: its cwd first
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return None  # whatever this is, the worker will say it better
    finally:
        sys.path[:] = saved
    if found:
        return None
    return (f"-m {name}: no module named {top} for {sys.executable} (looked in {cwd}, PYTHONPATH and "
            "site-packages); install it, or start the agent in the directory that holds it")


def _executable_problem(command: str, cwd: str) -> str | None:
    if os.sep in command:
        path = os.path.join(cwd, command)
        if not os.path.isfile(path):
            return f"--no-python {command}: no such file (in {cwd}); give the path of the program to run"
        if not os.access(path, os.X_OK):
            return f"--no-python {command} is not executable by this user; chmod +x it, or run it with python"
        return None
    if shutil.which(command) is None:
        return f"--no-python {command}: no such program on PATH; give its path, or install it"
    return None

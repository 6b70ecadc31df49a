"""Progress signals for the agent's hang watchdog, from any training script.

Under ``elastic agent`` every Python worker reports progress without a code change: the
agent's worker bootstrap calls :func:`install_optimizer_hook`, which registers torch's
global optimizer step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``)
to beat the heartbeat after each ``optimizer.step()``. If torch is not imported yet, the
hook is registered the moment ``torch.optim.optimizer`` is, so a worker that never uses
torch pays nothing.

A loop without a torch optimizer calls :func:`report_progress` once per step (one line,
microseconds); any loop may, to report its step, loss and samples (``elastic local`` shows
them). Once a script reports for itself the hook stops beating: both would overwrite the
same record, the hook's without the script's step, loss or samples. ``ElasticRun`` calls
:func:`take_over` and beats its committed steps itself. Outside the agent (no
``ELASTIC_HEARTBEAT_DIR``) every function here does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any

from .heartbeat import JOB_STEP, LOCAL_COUNT, NO_LOSS, Heartbeat

_HOOKED_MODULE = "torch.optim.optimizer"
_lock = threading.Lock()
_heartbeat: Heartbeat | None = None
_heartbeat_loaded = False
_count = 0
_samples = 0  # this process's running total of the samples reported (what the record carries)
_hook_handle: Any = None
_taken_over = False


def _beacon() -> Heartbeat | None:
    global _heartbeat, _heartbeat_loaded
    if not _heartbeat_loaded:
        _heartbeat, _heartbeat_loaded = Heartbeat.from_env(), True
    return _heartbeat


def report_progress(step: int | None = None, *, loss: float | None = None, samples: int = 0) -> None:
    """Tell the agent this rank made progress; ``step`` is the job's step if you know it.

    With ``step``, tools can also tell how many steps a fault rolled back; without it the
    agent only learns that the rank is alive and stepping. ``loss`` is this step's loss (a
    Python float: ``float()`` of a CUDA tensor waits for the GPU, so pass one you already
    have on the host, or leave it out). ``samples`` is how many samples this rank
    processed since its last report: its batch size, when called every step. Per report
    rather than a total, so a script keeps no count of its own and a restarted rank needs
    nothing restored; the record carries this process's running sum, from which
    ``elastic local`` shows samples/s.
    """
    beacon = _beacon()
    if beacon is None:
        return
    if not _taken_over:
        take_over()  # the script reports for itself: the optimizer hook's beats would overwrite its own
    _beat(beacon, step, loss, samples)


def _beat(beacon: Heartbeat, step: int | None, loss: float | None = None, samples: int = 0) -> None:
    global _count, _samples
    _samples += int(samples)
    loss_value = NO_LOSS if loss is None else float(loss)
    if step is None:
        _count += 1
        beacon.beat(_count, LOCAL_COUNT, loss_value, _samples)
    else:
        beacon.beat(int(step), JOB_STEP, loss_value, _samples)


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    beacon = _beacon()
    if not _taken_over and beacon is not None:
        _beat(beacon, None)


def _register() -> None:
    global _hook_handle
    with _lock:
        if _hook_handle is not None or _taken_over:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook_handle = register_optimizer_step_post_hook(_on_optimizer_step)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers the hook right after ``torch.optim.optimizer`` has been executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _HOOKED_MODULE:
            return None
        sys.meta_path.remove(self)  # once is enough; find the real spec with everyone else's finders
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register()

        loader.exec_module = exec_then_register
        return spec


def install_optimizer_hook() -> bool:
    """Beat the heartbeat after every optimizer step of this process (agent workers only).

    Returns whether a heartbeat exists to beat.
    """
    if _beacon() is None:
        return False
    if _HOOKED_MODULE in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    return True


def take_over() -> None:
    """Someone else beats from now on (``ElasticRun``, or the script through
    :func:`report_progress`); the optimizer hook stops beating."""
    global _taken_over, _hook_handle
    with _lock:
        _taken_over = True
        if _hook_handle is not None:
            _hook_handle.remove()
            _hook_handle = None

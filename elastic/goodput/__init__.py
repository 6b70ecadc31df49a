"""Goodput: the share of a job's wall time that became committed training progress.

Where the time goes is measured, not estimated:

* ``ElasticRun`` workers mark every second of their own (steps, snapshot stalls, each
  phase of a re-formation) in a :class:`GoodputLog` (:mod:`.recorder`);
* the agent that hosts rank 0 folds rank 0's marks, its own (detection and rendezvous of
  a restart) and, for scripts without ``ElasticRun``, its heartbeats into the job's record
  in etcd (:mod:`.account`, pure), and exports what each write added as counters;
* the record outlives every process, so the account survives any restart and is never
  counted twice across nodes.

No torch import here: the agent and ``elastic top`` use this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic._lazy import lazy_exports

_EXPORTS = {
    "Account": "elastic.goodput.account",
    "Fault": "elastic.goodput.account",
    "Interval": "elastic.goodput.account",
    "CAUSES": "elastic.goodput.account",
    "LOST_CAUSES": "elastic.goodput.account",
    "FAULT_PHASES": "elastic.goodput.account",
    "extend": "elastic.goodput.account",
    "added": "elastic.goodput.account",
    "name_faults": "elastic.goodput.account",
    "GoodputLog": "elastic.goodput.recorder",
    "GOODPUT_DIR_ENV": "elastic.contract",
    "read_job_file": "elastic.goodput.files",
    "newest_account": "elastic.goodput.files",
    "describe": "elastic.goodput.report",
    "describe_fault": "elastic.goodput.report",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .account import (CAUSES, FAULT_PHASES, LOST_CAUSES, Account, Fault, Interval, added, extend,
                          name_faults)
    from ..contract import GOODPUT_DIR_ENV
    from .files import newest_account, read_job_file
    from .recorder import GoodputLog
    from .report import describe, describe_fault


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

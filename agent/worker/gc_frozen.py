"""Preloaded modules kept out of every later garbage collection (``gc.freeze``).

A process that imports torch before it forks (the zygote, an agent's worker template, a
standby worker) holds a few hundred thousand long-lived objects: modules, functions, types.
Every full collection in it and in its forks walks all of them again, and the interpreter's
shutdown runs several: a worker whose script had returned took 3-5 s more to exit on this
2-core machine, one an agent (and so the job's end) waited for (docs/BENCHMARKS.md). Python's
documented remedy for a process that forks without exec is ``gc.freeze()`` right before the
forks: the objects move to a permanent generation that no collection visits, and the forks
do not write to their pages (copy-on-write memory stays shared). What is frozen is never
freed, which is what a preloaded module is anyway.
"""

from __future__ import annotations

import gc


def freeze_preloaded() -> None:
    """Collect once, then freeze what is left: the imports, not their garbage."""
    gc.collect()
    gc.freeze()


__all__ = ["freeze_preloaded"]

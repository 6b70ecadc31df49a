"""The suite's schedule on pytest-xdist workers: files as units, the heavy ones as one.

pytest-xdist's ``--dist loadgroup`` would say this with markers, but with pytest 9 it no
longer groups (it renames ``item._nodeid``, which pytest 9 stopped reading), so we give
xdist a scheduler through its public hook, ``pytest_xdist_make_scheduler``. It overrides
one private method, ``_split_scope`` (the unit a test belongs to), as xdist's own
``LoadFileScheduling`` does; ``tests/test_schedule.py`` fails loudly if xdist stops calling it.
"""

from __future__ import annotations

from typing import Any, Collection

from xdist.scheduler import LoadFileScheduling

HEAVY = "heavy"


def file_of(nodeid: str) -> str:
    """The test file a pytest node id belongs to."""
    return nodeid.split("::", 1)[0]


class HeavyTogether(LoadFileScheduling):
    """Each file one unit, and every file in ``heavy_files`` in one unit called ``heavy``."""

    def __init__(self, config: Any, log: Any, heavy_files: Collection[str]) -> None:
        super().__init__(config, log)
        self.heavy_files = frozenset(heavy_files)

    def _split_scope(self, nodeid: str) -> str:
        path = file_of(nodeid)
        return HEAVY if path in self.heavy_files else path

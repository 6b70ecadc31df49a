"""The suite's schedule on pytest-xdist workers: files as units, the heavy ones as one.

pytest-xdist's ``--dist loadgroup`` would say this with markers, but with pytest 9 it no
longer groups (it renames ``item._nodeid``, which pytest 9 stopped reading), so we give
xdist a scheduler through its public hook, ``pytest_xdist_make_scheduler``. It overrides
one private method, ``_split_scope`` (the unit a test belongs to), as xdist's own
``LoadFileScheduling`` does; ``tests/test_schedule.py`` fails loudly if xdist stops calling it.
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

from xdist.scheduler import LoadFileScheduling

HEAVY = "heavy"
# Each file's summed test seconds in a whole-suite run: the longest files go out first, so
# that the last ones handed out are short and no worker is left with a long file at the end.
# (The suite's packing, pytest's time per summed test-second, measured the same as in path
# order: docs/BENCHMARKS.md.) Only the order depends on it; refresh it with
# ``python -m tests.support.schedule JUNIT_XML > tests/support/file_seconds.json``.
SECONDS_FILE = Path(__file__).with_name("file_seconds.json")


def file_of(nodeid: str) -> str:
    """The test file a pytest node id belongs to."""
    return nodeid.split("::", 1)[0]


def file_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """The recorded seconds per test file (empty if the record is missing)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def longest_first(seconds: Mapping[str, float]) -> Callable[[str], float]:
    """A sort key over file paths: minus a file's recorded seconds; a file not recorded yet (a
    new one) counts as the median file, so it neither jumps the queue nor waits for the end.
    The median is taken once, not per test."""
    default = statistics.median(seconds.values()) if seconds else 0.0
    return lambda path: -seconds.get(path, default)


def seconds_from_junit(junit: Path, root: Path) -> dict[str, float]:
    """Summed test time per file from a pytest ``--junitxml`` report (classnames are dotted
    module paths, with a class name after them for a test in a class)."""
    summed: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        parts = case.get("classname", "").split(".")
        for end in range(len(parts), 0, -1):
            path = "/".join(parts[:end]) + ".py"
            if (root / path).is_file():
                summed[path] = summed.get(path, 0.0) + float(case.get("time", 0))
                break
    return {path: round(secs, 1) for path, secs in sorted(summed.items())}


class HeavyTogether(LoadFileScheduling):
    """Each file one unit, and every file in ``heavy_files`` in one unit called ``heavy``."""

    def __init__(self, config: Any, log: Any, heavy_files: Collection[str]) -> None:
        super().__init__(config, log)
        self.heavy_files = frozenset(heavy_files)

    def _split_scope(self, nodeid: str) -> str:
        path = file_of(nodeid)
        return HEAVY if path in self.heavy_files else path


if __name__ == "__main__":
    print(json.dumps(seconds_from_junit(Path(sys.argv[1]), Path(__file__).resolve().parents[2]), indent=0))

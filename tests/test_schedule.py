"""The suite's own schedule (tests/support/schedule.py) still holds with this pytest-xdist."""

from __future__ import annotations

import inspect

from xdist.scheduler import LoadScopeScheduling

from tests.conftest import HEAVY_FILES
from tests.support.schedule import HEAVY, HeavyTogether


def test_xdist_still_splits_its_units_with_the_method_we_override() -> None:
    assert "_split_scope" in inspect.getsource(LoadScopeScheduling.schedule), \
        "pytest-xdist no longer calls _split_scope: rewrite tests/support/schedule.py for its new interface"


def test_heavy_files_share_one_unit_and_every_other_file_is_its_own() -> None:
    scheduler = HeavyTogether.__new__(HeavyTogether)  # the split needs only the list
    scheduler.heavy_files = frozenset(HEAVY_FILES)
    heavy = [scheduler._split_scope(f"{path}::test_x[1]") for path in HEAVY_FILES]
    assert set(heavy) == {HEAVY}
    assert scheduler._split_scope("tests/agent/test_top.py::test_a") == "tests/agent/test_top.py"
    assert scheduler._split_scope("tests/agent/test_top.py::TestView::test_b[x@y]") == "tests/agent/test_top.py"

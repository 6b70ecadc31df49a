"""The suite's own schedule (tests/support/schedule.py) still holds with this pytest-xdist."""

from __future__ import annotations

import inspect
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

from tests.conftest import HEAVY_FILES
from tests.support.schedule import HEAVY, HeavyTogether, file_seconds, longest_first, seconds_from_junit

ROOT = Path(__file__).resolve().parents[1]


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


def test_the_recorded_seconds_name_only_test_files_that_exist() -> None:
    seconds = file_seconds()
    assert len(seconds) > 100, "tests/support/file_seconds.json is missing or nearly empty"
    gone = [path for path in seconds if not (ROOT / path).is_file()]
    assert not gone, (f"{gone} no longer exist: refresh the record with "
                      "python -m tests.support.schedule JUNIT_XML > tests/support/file_seconds.json")


def test_the_longest_file_goes_first_and_a_new_one_counts_as_the_median() -> None:
    seconds = {"tests/a.py": 100.0, "tests/b.py": 2.0, "tests/c.py": 10.0}
    order = sorted(["tests/b.py", "tests/c.py", "tests/a.py", "tests/new.py"], key=longest_first(seconds))
    assert order == ["tests/a.py", "tests/c.py", "tests/new.py", "tests/b.py"]  # stable: new after c, both 10 s
    assert longest_first({})("tests/x.py") == 0.0


def test_seconds_are_summed_per_file_from_a_junit_report(tmp_path: Path) -> None:
    (tmp_path / "tests" / "agent").mkdir(parents=True)
    (tmp_path / "tests" / "agent" / "test_x.py").touch()
    (tmp_path / "tests" / "test_y.py").touch()
    junit = tmp_path / "junit.xml"
    junit.write_text('''<testsuites><testsuite>
<testcase classname="tests.agent.test_x" name="test_a" time="1.25"/>
<testcase classname="tests.agent.test_x.TestView" name="test_b" time="2.5"/>
<testcase classname="tests.test_y" name="test_c" time="0.04"/>
</testsuite></testsuites>''')
    assert seconds_from_junit(junit, tmp_path) == {"tests/agent/test_x.py": 3.8, "tests/test_y.py": 0.0}

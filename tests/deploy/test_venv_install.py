"""deploy/venv_install.py: the wheels pip chose are shared between the cores by size, every
one installed exactly once, and a local file's size is read from the report's own URL."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("venv_install", REPO / "deploy" / "venv_install.py")
assert _spec is not None and _spec.loader is not None
venv_install = importlib.util.module_from_spec(_spec)
sys.modules["venv_install"] = venv_install
_spec.loader.exec_module(venv_install)
Wheel = venv_install.Wheel


def test_the_largest_wheels_go_to_different_cores_and_every_wheel_once() -> None:
    sizes = {"torch": 555, "cudnn": 553, "cublas": 423, "nccl": 216, "cufft": 214, "numpy": 17, "sympy": 6}
    wheels = [Wheel(n, f"file:///w/{n}.whl", s) for n, s in sizes.items()]
    groups = venv_install.shares(wheels, 2)
    assert sorted(w.name for g in groups for w in g) == sorted(sizes)
    loads = [sum(w.size for w in g) for g in groups]
    assert {groups[0][0].name, groups[1][0].name} == {"torch", "cudnn"}
    assert max(loads) - min(loads) <= 17  # no better split moves less than the smallest big wheel


def test_more_cores_than_wheels_makes_one_group_a_wheel_and_unknown_sizes_still_spread() -> None:
    wheels = [Wheel(n, f"https://example.invalid/{n}.whl", 0) for n in ("a", "b", "c")]
    assert [len(g) for g in venv_install.shares(wheels, 8)] == [1, 1, 1]
    assert [len(g) for g in venv_install.shares(wheels, 2)] == [2, 1]
    assert venv_install.shares([], 2) == []


def test_a_reports_local_wheel_is_sized_from_its_file_and_a_remote_one_is_zero(tmp_path: Path) -> None:
    local = tmp_path / "torch 1.whl"
    local.write_bytes(b"x" * 1234)
    report = {"install": [
        {"metadata": {"name": "torch"}, "download_info": {"url": local.as_uri()}},
        {"metadata": {"name": "rich"}, "download_info": {"url": "https://files.example.invalid/rich.whl"}},
    ]}
    assert venv_install.wheels_of(report) == [Wheel("torch", local.as_uri(), 1234),
                                             Wheel("rich", "https://files.example.invalid/rich.whl", 0)]


def test_no_requirement_is_a_usage_line_and_exit_2(capsys) -> None:
    assert venv_install.main([]) == 2
    assert "usage: venv_install.py REQUIREMENT" in capsys.readouterr().err

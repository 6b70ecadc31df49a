"""Suspect hardware: the pure keep-out rule, and the agent reading its workers' events as facts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.node.policy import SDC_WINDOW_S, sdc_keep_out
from agent.node.sdc import SdcWatch, window_from_env


def test_twice_the_outlier_within_the_window_is_suspect_hardware() -> None:
    assert sdc_keep_out([], 1000.0) is None
    assert sdc_keep_out([990.0], 1000.0) is None  # once: a cosmic ray happens
    detail = sdc_keep_out([500.0, 990.0], 1000.0, window_s=600.0)
    assert detail is not None and "2 times within 600 s" in detail and "suspect hardware" in detail
    assert sdc_keep_out([100.0, 990.0], 1000.0, window_s=600.0) is None  # the first is too old
    assert sdc_keep_out([990.0, 995.0, 999.0], 1000.0, window_s=600.0, strikes=3) is not None
    assert sdc_keep_out([990.0, 2000.0], 1000.0) is None  # from the future: a clock step, not counted
    assert SDC_WINDOW_S == 86400.0


def _event(path: Path, role: str, at: float, step: int = 12) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"time": at, "role": role, "step": step, "differing": ["0.weight"]}) + "\n")


def test_the_watch_counts_outlier_events_only_and_forgets_after_a_keep_out(tmp_path: Path) -> None:
    watch = SdcWatch("n1", tmp_path, window_s=600.0)
    assert not watch.look(1000.0).suspect
    _event(tmp_path / "sdc-0.jsonl", "suspect", 900.0)  # one of two replicas: never counts
    _event(tmp_path / "sdc-1.jsonl", "outlier", 950.0)
    assert not watch.look(1000.0).suspect
    with open(tmp_path / "sdc-1.jsonl", "a") as f:
        f.write('{"time": 990.0, "role": "outl')  # half a line: read at the next look, whole
    assert not watch.look(1000.0).suspect
    with open(tmp_path / "sdc-1.jsonl", "a") as f:
        f.write('ier", "step": 20}\n')
    assert watch.look(1000.0).suspect
    assert watch.look(1000.0).outlier_at == (950.0, 990.0)  # the facts the policy weighs
    watch.forget()
    assert not watch.look(1001.0).suspect  # the same events are not read twice


def test_the_window_setting(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("ELASTIC_SDC_WINDOW_S", "3600")
    assert window_from_env() == 3600.0
    monkeypatch.setenv("ELASTIC_SDC_WINDOW_S", "soon")
    assert window_from_env() == SDC_WINDOW_S and "not seconds above 0" in caplog.text

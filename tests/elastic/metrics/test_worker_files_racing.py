"""A worker file read the moment its worker creates it: empty, or cut short.

prometheus_client raises ``struct.error`` on an empty ``*.db`` file. The agent reads the
workers' directory at every look (its straggler watch) and at every scrape; a new worker on
a loaded machine left such a file long enough for an agent to crash on it ("the agent on c
crashed: unpack_from requires a buffer of at least 4 bytes"), which failed the whole job.
The files here are real values written by prometheus_client's own multiprocess mode in this
process (no worker needed), beside an empty and a truncated one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client import values as _values

from agent.node.pace import COMPUTE, local_pace
from elastic.metrics import collector_registry
from elastic.metrics.multiprocess import merged


@pytest.fixture
def directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(_values, "ValueClass", _values.get_value_class())  # this process writes its own file
    gauge = Gauge(COMPUTE, "compute", registry=CollectorRegistry(), multiprocess_mode="max")
    gauge.set(0.25)
    (tmp_path / "gauge_max_99999.db").write_bytes(b"")  # a worker creating its file right now
    (tmp_path / "gauge_max_99998.db").write_bytes(b"\x40\x00\x00\x00")  # ... or cut short
    return tmp_path


def test_the_straggler_watch_reads_the_live_values_past_a_file_being_created(directory: Path) -> None:
    assert local_pace(directory) == 0.25
    assert any(m.name == COMPUTE for m in merged(directory))


def test_a_scrape_serves_the_live_values_past_a_file_being_created(directory: Path) -> None:
    text = generate_latest(collector_registry(directory)).decode()
    assert f"{COMPUTE}{{" in text or f"{COMPUTE} " in text, text
    assert os.path.getsize(directory / "gauge_max_99999.db") == 0  # left as it was: the worker owns it

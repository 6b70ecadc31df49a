"""Fixtures shared by the trainer's in-process tests."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The script's own group (as a user's would be), outside any agent."""
    monkeypatch.delenv("ELASTIC_CONTROL_DIR", raising=False)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

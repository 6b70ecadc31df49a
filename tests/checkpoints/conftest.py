from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def _mount(args: list[str]) -> str | None:
    r = subprocess.run(args, capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs, so ENOSPC comes from a real filesystem, not a mock."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    err = _mount(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)])
    if err is not None:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here ({err}); the full-disk tests need root or CAP_SYS_ADMIN")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only bind mount: unlike chmod, it stops root too."""
    src = tmp_path / "ro-src"
    src.mkdir()
    mnt = tmp_path / "ro"
    mnt.mkdir()
    err = _mount(["mount", "--bind", str(src), str(mnt)])
    if err is None:
        err = _mount(["mount", "-o", "remount,ro,bind", str(mnt)])
        if err is not None:
            subprocess.run(["umount", str(mnt)], check=False)
    if err is not None:
        pytest.skip(f"cannot make a read-only bind mount here ({err}); needs root or CAP_SYS_ADMIN")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)

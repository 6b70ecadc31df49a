from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.s3server import SeaweedS3

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def bucket(s3_server: SeaweedS3, request: pytest.FixtureRequest) -> str:
    """A bucket of the session's S3 server for this test module alone."""
    module = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    return s3_server.bucket(f"{module}-{os.getpid()}"[:63])


@pytest.fixture
def s3(s3_server: SeaweedS3, bucket: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix's URL, with the server's endpoint and credentials in the AWS variables."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{bucket}/job-{next(_prefixes)}"


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

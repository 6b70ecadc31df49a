"""Helpers shared by the tests and the child processes they start (no pytest import here)."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def state_for(step: int, numel: int = 1 << 18) -> dict[str, Any]:
    """A training-like state that is a deterministic function of ``step``."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "layer.weight": torch.randn(numel, generator=g),
            "layer.bias": torch.full((7,), float(step)),
            "bn.num_batches_tracked": torch.tensor(step),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(numel, generator=g)}},
            "param_groups": [{"lr": 0.1 / (step + 1), "betas": (0.9, 0.999), "params": [0]}],
        },
        "sampler": {"epoch": step // 10, "offset": step * 32, "seed": 1234},
        "step": step,
        "note": f"step {step}",
    }


def assert_equal_state(a: Any, b: Any, where: str = "state") -> None:
    """Bitwise equality of nested state, with a path in the failure message."""
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)), (
        f"{where}: {type(a)} != {type(b)}"
    )
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        assert torch.equal(a, b), f"{where}: tensor values differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_equal_state(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def cli_rows(out: str) -> dict[str, str]:
    """The table ``python -m checkpoints`` printed (plain text, not a tty): step -> its line."""
    rows = {}
    for line in out.splitlines()[1:]:
        parts = line.split()
        if parts and parts[0].isdigit() and "snapshot(s)" not in line:
            rows[parts[0]] = line
    return rows


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(HERE), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


class LineReader:
    """Reads a child's stdout on a thread so the test can wait for lines with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        assert proc.stdout is not None
        self._t = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._t.start()

    def _pump(self, f: Any) -> None:
        for line in f:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line starting {prefix!r} within {timeout}s; saw {self.seen[-5:]}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"child exited before printing {prefix!r}; saw {self.seen[-5:]}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line


def start_child(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,
        text=True,
        env=child_env(),
        cwd=str(REPO_ROOT),
    )


def stop_child(proc: subprocess.Popen[str]) -> None:
    """Kill a child we started (by its pid) and reap it; safe to call twice."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    finally:
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


def assert_pending_flushed(root: Path, flushed_line: str) -> int:
    """A SIGTERMed ``_ckpt_writer_child.py`` flushed the step it had in flight: that step is
    durable and holds its own data. Returns the step."""
    from checkpoints import SnapshotStore

    pending = flushed_line.split("=")[1]
    assert pending != "None", "SIGTERM did not land during a write; the test proved nothing"
    got = SnapshotStore(root).load(int(pending))
    assert int(got["model"]["marker"]) == int(pending) == got["step"]
    return int(pending)


@contextlib.contextmanager
def pruning_held(step_dir: Path) -> Iterator[Callable[[], None]]:
    """A snapshot newer than any the test saves, whose manifest is a FIFO: pruning, which
    checks snapshots from the newest down, blocks on it until released; then it reads junk
    and leaves that dir alone (an invalid snapshot newer than the kept ones stays for a human).
    Released on the way out in any case, so a failing test cannot hang in close()."""
    step_dir.mkdir()
    fifo = step_dir / "MANIFEST.json"
    os.mkfifo(fifo)

    def open_writer() -> int | None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: nobody is reading it yet
            return None

    def feed_junk(fd: int) -> None:
        os.write(fd, b"not json")
        os.close(fd)

    def release() -> None:
        from tests.support.waiting import wait_until  # not at import: the child processes lack it

        feed_junk(wait_until(open_writer, 60, "the pruning to open the blocking manifest"))

    try:
        yield release
    finally:
        fd = open_writer()
        if fd is not None:
            feed_junk(fd)
        fifo.unlink(missing_ok=True)  # a later reader finds no manifest rather than blocking

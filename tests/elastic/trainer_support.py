"""Helpers for the trainer's integration tests: start runner nodes, read progress, compare state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tests.support.nodes import TorchrunNode
from tests.support.waiting import wait_until


def start_runner(
    nodes: Callable[..., TorchrunNode], name: str, *, endpoint: str, run_id: str, workdir: Path,
    args: Sequence[str], nnodes: str,
) -> TorchrunNode:
    """A node running ``python -m elastic.train`` that reports progress to ``<name>.progress.jsonl``."""
    return nodes(
        name=name, endpoint=endpoint, run_id=run_id, module="elastic.train", nnodes=nnodes,
        module_args=[*args, "--progress", str(workdir / f"{name}.progress.jsonl")],
        # 2 cores shared by every worker of every node. These tests kill nodes (a reset
        # connection says so at once) and freeze none: the freeze probe, which asks a silent
        # peer's agent for an answer within 0.3 s, once wrote off a live node of a loaded
        # whole-suite run, and a restart of its worker failed the resize test
        env={"OMP_NUM_THREADS": "1", "ELASTIC_FREEZE_PROBE": "0"},
    )


def logs(*group: TorchrunNode) -> Callable[[], str]:
    return lambda: "\n".join(n.log_tail(60) for n in group)


def latest(node: TorchrunNode) -> dict[str, Any] | None:
    rows = node.progress()
    return rows[-1] if rows else None


def wait_for_step(node: TorchrunNode, step: int, *group: TorchrunNode, world_size: int | None = None,
                  after: float = 0.0, timeout: float = 120.0) -> dict[str, Any]:
    """The first progress row (written after ``after``) at or past ``step``, at ``world_size``."""
    def probe() -> dict[str, Any] | None:
        for row in node.progress():
            if row["time"] >= after and row["step"] >= step and world_size in (None, row["world_size"]):
                return row
        return None

    what = f"{node.name} to reach step {step}" + (f" at world size {world_size}" if world_size else "")
    return wait_until(probe, timeout, what, on_timeout=logs(node, *group))


def wait_all_exit(group: Sequence[TorchrunNode], timeout: float = 180.0) -> None:
    wait_until(lambda: not any(n.alive() for n in group), timeout, "every node to finish", on_timeout=logs(*group))
    codes = {n.name: n.process.returncode for n in group if n.process is not None}
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{logs(*group)()}"


def assert_state_equal(a: Any, b: Any, where: str = "state") -> None:
    """Bitwise: same structure, same dtypes, same bits (``torch.equal``, NaN-safe via views)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(_bits(a), _bits(b)), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_state_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

"""The sample ledger: proof, from outside the job, that no sample was lost or repeated.

Rank 0 appends one JSON line per committed step: which incarnation wrote it, the epoch,
the step number, the world size and the ids of every sample in the global batch. The ids
are recomputed from the sampler state (deterministic), so the ledger costs no collective.

Durability: each line is flushed to the OS (a SIGKILL of the worker loses nothing already
written, at most a half line, which the checker skips). There is no fsync per step; the
trainer fsyncs the ledger whenever it takes a snapshot, so a machine crash can lose only
lines after the newest snapshot, i.e. steps that will be redone anyway.

:func:`check_ledger` reads a ledger back. Steps redone after a restore supersede the
rolled-back records: for each step number the record of the latest incarnation to write
it counts, once; so does the newer round's record of a step an older round's frozen rank 0
committed late (:func:`late_commits`). It is a plain function so the chaos soak can reuse it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Sequence

from . import worker_env


class LedgerError(RuntimeError):
    """The ledger file cannot be written; one line."""


def incarnation_id() -> str:
    """torchrun's restart count plus a per-process random tag: unique per worker start."""
    return f"r{worker_env.read().me.restart_count}-{secrets.token_hex(4)}"


class Ledger:
    """Append-only writer, used by rank 0 only."""

    def __init__(self, path: str | os.PathLike[str], incarnation: str | None = None) -> None:
        self.path = Path(path)
        self.incarnation = incarnation or incarnation_id()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise LedgerError(f"ledger {self.path}: cannot append ({e.strerror or e}); pass a writable path") from None
        self._seq = 0
        self.resumed_from = 0  # the step the current world started from (set by the trainer)

    def record(self, *, epoch: int, step: int, world_size: int, samples: Sequence[int], resumed_from: int,
               round_number: int = -1) -> None:
        line = {
            "incarnation": self.incarnation, "seq": self._seq, "time": time.time(), "epoch": epoch,
            "step": step, "world_size": world_size, "resumed_from": resumed_from, "samples": list(samples),
        }
        if round_number >= 0:
            line["round"] = round_number  # the rendezvous round of the group that committed it (split-brain check)
        self._seq += 1
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()


@dataclass(frozen=True)
class LedgerReport:
    violations: list[str]
    steps: int  # distinct committed steps after superseding
    completed_epochs: list[int]
    incarnations: list[str]  # in the order they first wrote

    @property
    def ok(self) -> bool:
        return not self.violations


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every parseable record in file order; a line cut short by a kill is skipped."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def effective_steps(rows: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per step number, the record written last (a later incarnation redid that step)."""
    latest: dict[int, dict[str, Any]] = {}
    for row in rows:  # file order is time order: one rank 0 appends at a time
        latest[int(row["step"])] = row
    return latest


def check_ledger(
    path: str | os.PathLike[str],
    dataset_size: int,
    *,
    final_step: int | None = None,
    expect_epochs: int | None = None,
) -> LedgerReport:
    """Violations of "every sample of each completed epoch exactly once".

    ``final_step`` bounds the steps considered (default: the last step written by the
    last incarnation; records beyond it belong to a rolled-back timeline still to be
    redone). ``expect_epochs`` additionally demands that many completed epochs.
    """
    rows = read_ledger(path)
    violations: list[str] = []
    if not rows:
        return LedgerReport(["ledger is empty"], 0, [], [])
    incarnations = list(dict.fromkeys(r["incarnation"] for r in rows))
    late = late_commits(rows)
    violations += split_brain(rows, late)
    rows = [r for i, r in enumerate(rows) if i not in late]  # superseded by the newer round's line of that step
    if final_step is None:
        final_step = max(int(r["step"]) for r in rows if r["incarnation"] == rows[-1]["incarnation"])
    latest = {s: r for s, r in effective_steps(rows).items() if s <= final_step}
    missing = sorted(set(range(1, final_step + 1)) - set(latest))
    if missing:
        violations.append(f"steps not contiguous: missing {_ranges(missing)} of 1..{final_step}")

    by_epoch: dict[int, list[int]] = {}
    last_epoch = -1
    for step in sorted(latest):
        row = latest[step]
        epoch = int(row["epoch"])
        if epoch < last_epoch:
            violations.append(f"step {step} is in epoch {epoch} after a step of epoch {last_epoch}")
        last_epoch = max(last_epoch, epoch)
        by_epoch.setdefault(epoch, []).extend(int(s) for s in row["samples"])

    completed = []
    for epoch, samples in sorted(by_epoch.items()):
        counts = Counter(samples)
        repeated = sorted(s for s, c in counts.items() if c > 1)
        outside = sorted(s for s in counts if not 0 <= s < dataset_size)
        if repeated:
            violations.append(f"epoch {epoch}: samples seen more than once: {_some(repeated)}")
        if outside:
            violations.append(f"epoch {epoch}: sample ids outside 0..{dataset_size - 1}: {_some(outside)}")
        is_complete = len(counts) == dataset_size or epoch < last_epoch
        if is_complete:
            lost = sorted(set(range(dataset_size)) - set(counts))
            if lost:
                violations.append(f"epoch {epoch}: {len(lost)} sample(s) never seen: {_some(lost)}")
            else:
                completed.append(epoch)
    if expect_epochs is not None and len(completed) < expect_epochs:
        violations.append(f"expected {expect_epochs} completed epoch(s), found {len(completed)}: {completed}")
    return LedgerReport(violations, len(latest), completed, incarnations)


def split_brain(rows: Iterable[dict[str, Any]], late: set[int] | None = None) -> list[str]:
    """Lines committed by a group of an older round after a newer round's group committed.

    Every group commits under the snapshot directory's fence, so the file order is the
    commit order and the rounds in it never go back; a line that does means two groups
    committed steps for one job at once. One exception, a **late commit**
    (:func:`late_commits`; ``late``: those already found), is not a split brain. Lines
    without a round (no ``elastic agent`` round, or an older ledger) are not judged.
    """
    rows = list(rows)
    late = late_commits(rows) if late is None else late
    return [f"split brain: step {rows[i]['step']} committed by round {rows[i]['round']} "
            f"(incarnation {rows[i]['incarnation']}) after round {newest['round']} had committed step "
            f"{newest['step']}: two groups committed steps at once"
            for i, newest in _behind(rows) if i not in late]


def _behind(rows: Sequence[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """Each line of an older round than a line before it: its index, and the newest round's
    line it came after."""
    found: list[tuple[int, dict[str, Any]]] = []
    newest: dict[str, Any] | None = None
    for i, row in enumerate(rows):
        if "round" not in row:
            continue
        if newest is not None and int(row["round"]) < int(newest["round"]):
            found.append((i, newest))
        if newest is None or int(row["round"]) >= int(newest["round"]):
            newest = row
    return found


def late_commits(rows: Sequence[dict[str, Any]]) -> set[int]:
    """Indices of the lines an older round's rank 0 completed after a newer round's line,
    each the one commit the fence had admitted before the newer round raised it.

    The raise goes on without a frozen holder's lock (:mod:`checkpoints.fence`), so a rank 0
    frozen inside its commit writes that one line when it thaws, and is refused from the
    next on. Its step was trained by its group, and the newer round, which took over from
    that group's survivors, records the same step itself (before the late line or, after a
    rollback, when it trains it again). So a line is late, and is superseded rather than a
    split brain, when it is the only line its incarnation wrote after a newer round's, and
    a newer round's line records the same step with the same samples. Anything more (a
    second line, another step, other samples) is two groups committing at once."""
    after: dict[str, list[int]] = {}  # incarnation -> its lines written after a newer round's line
    for i, _ in _behind(rows):
        after.setdefault(str(rows[i]["incarnation"]), []).append(i)
    late: set[int] = set()
    for lines in after.values():
        if len(lines) != 1:
            continue
        row = rows[lines[0]]
        if any("round" in other and int(other["round"]) > int(row["round"]) and other["step"] == row["step"]
               and other.get("samples") == row.get("samples") for other in rows):
            late.add(lines[0])
    return late


def _some(items: list[int], limit: int = 10) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(map(str, items[:limit])) + more


def _ranges(steps: list[int]) -> str:
    out, start, prev = [], steps[0], steps[0]
    for s in steps[1:] + [None]:
        if s is None or s != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            if s is not None:
                start = s
        if s is not None:
            prev = s
    return ", ".join(out)

"""``ElasticRun``'s settings for snapshots and for data, each in one small object.

    run = ElasticRun(model, optimizer, dataset, global_batch_size=64, epochs=10,
                     snapshot_dir="/shared/ckpt/job1",
                     snapshots=SnapshotConfig(every_steps=200, keep=5, ledger="ledger.jsonl"),
                     data=DataConfig(num_workers=4, collate_fn=pad))

The run checks each object's values before any process group or snapshot directory is
touched, so a wrong one is a usage error with one line (exit code 2), as any other. These
objects are the one way to give these settings (0.1.0): a flat keyword of earlier releases
(``snapshot_every_steps=``, ``keep_snapshots=``, ``num_workers=``...) is a ``TypeError``
naming the field it moved to (:func:`refuse_flat_keywords`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from .distributed import ElasticRunError

BatchPolicy = Literal["fixed-global", "fixed-per-rank"]
WriterMode = Literal["process", "thread"]


@dataclass(frozen=True)
class SnapshotConfig:
    """When rank 0 snapshots the run, how many it keeps, and what else it writes.

    ``every_steps``/``every_seconds``: a snapshot is due after that many committed steps or
    seconds, whichever comes first (None, or 0 steps: never on that count). ``keep``: snapshots kept
    (plus one spare, the last pruned, whose files the next one writes over). ``writer``: a
    writer process at idle priority (the default) or a thread. ``ledger``: a JSON line per
    committed step. ``meta``: saved with every snapshot (the job's name, say)."""

    every_steps: int | None = 100
    every_seconds: float | None = None
    keep: int = 3
    writer: WriterMode = "process"
    ledger: str | Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if self.every_steps is not None and self.every_steps < 0:
            raise ElasticRunError(f"snapshot every_steps must be >= 1 (0 or None: not by steps), got {self.every_steps}")
        if self.every_seconds is not None and not self.every_seconds >= 0:
            raise ElasticRunError(f"snapshot every_seconds must be >= 0 (None: not by time), got {self.every_seconds}")
        if self.keep < 1:
            raise ElasticRunError(f"keep must be >= 1 snapshot, got {self.keep}")
        if self.writer not in ("process", "thread"):
            raise ElasticRunError(f"unknown snapshot writer {self.writer!r}; use process or thread")


@dataclass(frozen=True)
class DataConfig:
    """How the global batch is split and how each rank's share is loaded.

    ``batch_policy="fixed-global"`` (the default) keeps the global batch at every world size;
    ``"fixed-per-rank"`` keeps ``per_rank_batch_size`` and scales the learning rate linearly
    with the global batch. ``num_workers``, ``collate_fn`` and ``pin_memory`` go to the
    ``DataLoader``; ``pin_memory`` only matters when training on CUDA, where ``None`` pins
    (give ``False`` for a dataset whose samples already live on the GPU: those cannot be
    pinned)."""

    batch_policy: BatchPolicy = "fixed-global"
    per_rank_batch_size: int | None = None
    num_workers: int = 0
    collate_fn: Callable[[list[Any]], Any] | None = None
    pin_memory: bool | None = None

    def check(self) -> None:
        if self.batch_policy not in ("fixed-global", "fixed-per-rank"):
            raise ElasticRunError(f"unknown batch policy {self.batch_policy!r}; use fixed-global or fixed-per-rank")
        if self.batch_policy == "fixed-per-rank" and not self.per_rank_batch_size:
            raise ElasticRunError("batch policy fixed-per-rank needs a per-rank batch size")
        if self.num_workers < 0:
            raise ElasticRunError(f"num_workers must be >= 0, got {self.num_workers}")


# The flat keywords of earlier releases: name -> (which object, its field), for the message
# that says where each one went.
FLAT_KEYWORDS: dict[str, tuple[str, str]] = {
    "snapshot_every_steps": ("snapshots", "every_steps"),
    "snapshot_every_seconds": ("snapshots", "every_seconds"),
    "keep_snapshots": ("snapshots", "keep"),
    "snapshot_writer": ("snapshots", "writer"),
    "ledger": ("snapshots", "ledger"),
    "snapshot_meta": ("snapshots", "meta"),
    "batch_policy": ("data", "batch_policy"),
    "per_rank_batch_size": ("data", "per_rank_batch_size"),
    "num_workers": ("data", "num_workers"),
    "collate_fn": ("data", "collate_fn"),
    "pin_memory": ("data", "pin_memory"),
}
_CLASS = {"snapshots": "SnapshotConfig", "data": "DataConfig"}


def grouped_form(name: str) -> str | None:
    """Where flat keyword ``name`` went, as code (``snapshots=SnapshotConfig(keep=...)``); None: not one."""
    if name not in FLAT_KEYWORDS:
        return None
    which, attribute = FLAT_KEYWORDS[name]
    return f"{which}={_CLASS[which]}({attribute}=...)"


def refuse_flat_keywords(flat: dict[str, Any], caller: str = "ElasticRun") -> None:
    """A keyword ``caller`` does not take: one ``TypeError`` line that says how to fix it (a
    flat keyword of earlier releases: the grouped form it moved to)."""
    if not flat:
        return
    name = sorted(flat)[0]
    form = grouped_form(name)
    if form is None:
        raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    cls = _CLASS[FLAT_KEYWORDS[name][0]]
    raise TypeError(f"{caller}({name}=) is gone since 0.1.0: give {form} (from elastic import {cls})")


def checked(snapshots: SnapshotConfig | None, data: DataConfig | None) -> tuple[SnapshotConfig, DataConfig]:
    """The two objects (the defaults for one not given), each value checked (a usage error)."""
    snapshot_config, data_config = snapshots or SnapshotConfig(), data or DataConfig()
    snapshot_config.check()
    data_config.check()
    return snapshot_config, data_config


__all__ = ["BatchPolicy", "DataConfig", "FLAT_KEYWORDS", "SnapshotConfig", "WriterMode", "checked", "grouped_form",
           "refuse_flat_keywords"]

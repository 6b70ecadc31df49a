"""A resumed run continues bitwise-identically to one that never stopped."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from checkpoints import (
    AsyncSnapshotWriter,
    SnapshotMismatchError,
    SnapshotStore,
    capture_rng_state,
    check_state_compatible,
    restore_rng_state,
)
from ckpt_testutil import assert_equal_state


class Trainer:
    """Model with BatchNorm and dropout, SGD+momentum and Adam, a scheduler, a GradScaler."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2), nn.Linear(4 * 6 * 6, 5)
        )
        self.sgd = torch.optim.SGD(list(self.model[0].parameters()) + list(self.model[1].parameters()), lr=0.05, momentum=0.9)
        self.adam = torch.optim.Adam(self.model[5].parameters(), lr=1e-3)
        self.sched = torch.optim.lr_scheduler.StepLR(self.adam, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        self.sampler = {"epoch": 0, "offset": 0, "seed": seed}

    def step(self) -> None:
        x = torch.randn(8, 3, 8, 8) * (0.5 + random.random()) + float(np.random.rand())
        y = torch.randint(0, 5, (8,))
        loss = nn.functional.cross_entropy(self.model(x), y)
        for o in (self.sgd, self.adam):
            o.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.sgd)
        self.scaler.step(self.adam)
        self.scaler.update()
        self.sched.step()
        self.sampler["offset"] += 8

    def components(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "sgd": self.sgd.state_dict(),
            "adam": self.adam.state_dict(),
            "scheduler": self.sched.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": dict(self.sampler),
        }

    def state(self) -> dict[str, Any]:
        return {**self.components(), "rng": capture_rng_state(), "step": 3, "epoch": 0}

    def restore(self, s: dict[str, Any]) -> None:
        check_state_compatible(self.model.state_dict(), s["model"], "model")
        self.model.load_state_dict(s["model"])
        self.sgd.load_state_dict(s["sgd"])
        self.adam.load_state_dict(s["adam"])
        self.sched.load_state_dict(s["scheduler"])
        self.scaler.load_state_dict(s["scaler"])
        self.sampler = dict(s["sampler"])
        restore_rng_state(s["rng"])

    def fingerprint(self) -> dict[str, Any]:
        return {
            **self.components(),
            "next": (torch.rand(4), random.random(), float(np.random.rand()), random.gauss(0, 1)),
        }


def _reference(store: SnapshotStore, save: Any) -> dict[str, Any]:
    random.seed(1)
    np.random.seed(2)
    t = Trainer(seed=0)
    for _ in range(3):
        t.step()
    random.gauss(0, 1)  # leaves a cached gauss in Python's RNG state
    save(t)
    for _ in range(2):
        t.step()
    return t.fingerprint()


def _resumed(store: SnapshotStore) -> dict[str, Any]:
    random.seed(99)
    np.random.seed(99)
    t = Trainer(seed=42)  # different init: everything must come from the snapshot
    found = store.load_latest()
    assert found is not None and found[0].step == 3
    t.restore(found[1])
    for _ in range(2):
        t.step()
    return t.fingerprint()


def test_sync_save_resume_is_bitwise_identical(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    ref = _reference(store, lambda t: store.save(3, t.state(), world_size=1))
    assert_equal_state(_resumed(store), ref)


@pytest.mark.slow  # starts processes
def test_async_save_resume_is_bitwise_identical(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    with AsyncSnapshotWriter(store) as writer:

        def save(t: Trainer) -> None:
            writer.attach_optimizer(t.sgd)
            writer.attach_optimizer(t.adam)
            assert writer.submit(3, t.state(), world_size=1)

        ref = _reference(store, save)
    assert_equal_state(_resumed(store), ref)


def test_rng_round_trip_through_weights_only_load(tmp_path: Path) -> None:
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    state = capture_rng_state()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    store = SnapshotStore(tmp_path)
    store.save(1, {"rng": state}, world_size=1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    restore_rng_state(store.load(1)["rng"])
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    assert ("cuda" in state) == torch.cuda.is_available()


def test_snapshot_from_another_model_names_the_keys() -> None:
    live = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).state_dict()
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(3, 1)).state_dict()
    with pytest.raises(SnapshotMismatchError) as err:
        check_state_compatible(live, other, "model")
    msg = str(err.value)
    assert "unexpected 2.weight" in msg and "unexpected 2.bias" in msg
    assert "shape mismatch 1.weight (snapshot [3, 8] vs live [2, 8])" in msg
    assert "\n" not in msg and "different model" in msg

    many = {f"layer{i}.weight": torch.zeros(1) for i in range(9)}
    with pytest.raises(SnapshotMismatchError, match=r"missing layer4.weight and 4 more;"):
        check_state_compatible(many, {}, "model")
    check_state_compatible(live, dict(live), "model")  # same model: no error

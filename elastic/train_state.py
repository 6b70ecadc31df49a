"""Everything a run needs to go on, as one tree of tensors and plain numbers.

The same tree is written to disk as a snapshot and sent to a rank that needs healing
(:mod:`elastic.inplace.transfer`), and :meth:`TrainState.load` takes either: one restore
path, whether the state comes from a file or from a live replica. What the user's loop
registered (:mod:`elastic.user_state`) is part of it, under ``"user"``, so it goes
wherever the model goes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from checkpoints import capture_rng_state, check_state_compatible, restore_rng_state

from .distributed import ElasticRunError
from .sampler import ElasticSampler
from .user_state import UserState


class TrainState:
    """Model, optimizer, scheduler, scaler, sampler, progress, RNG and the loop's registered state."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler,
                 scheduler: Any = None, scaler: Any = None) -> None:
        self.module, self.optimizer, self.sampler = module, optimizer, sampler
        self.scheduler, self.scaler = scheduler, scaler
        self.step = 0  # completed optimizer steps since the job began
        self.samples = 0  # samples those steps consumed
        self.user = UserState()  # what the loop registered (run.register)
        self.sharded = False  # an FSDP2 model: its state is gathered and scattered by every rank at once
        self.shards_in_snapshots = False  # sharded, and every rank snapshots its own shards (no gather)
        self.loads = 0  # states loaded so far: a host copy taken before the last load is of another state

    def _model_and_optimizer(self, local: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.sharded and local:
            from .inplace.hsdp import capture_local

            return capture_local(self.module, self.optimizer)  # this rank's shards, for a peer of the same local rank
        if self.sharded and self.shards_in_snapshots:
            from .sharded import sharded_state

            return sharded_state(self.module, self.optimizer)  # DTensors: each rank's own shards, for DCP
        if self.sharded:
            from .sharded import full_state

            return full_state(self.module, self.optimizer)  # a collective: every rank calls capture at once
        return self.module.state_dict(), self.optimizer.state_dict()

    def capture(self, local: bool = False) -> dict[str, Any]:
        """The whole state (``local``: a sharded model's own shards, for a heal in place)."""
        model, optimizer = self._model_and_optimizer(local)
        state: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "sampler": self.sampler.state_dict(),
            "progress": {"step": self.step, "samples": self.samples},
            "rng": capture_rng_state(),
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if len(self.user):
            state["user"] = self.user.capture()
        return state

    def load(self, state: dict[str, Any], local: bool = False) -> None:
        """Take ``state`` (a snapshot or a replica's; ``local``: a sharded replica's own shards);
        a mismatch is the user's to fix, in one line."""
        from checkpoints.reading import DCP_DIR_KEY, DCP_FILES_KEY

        self.loads += 1
        if DCP_DIR_KEY in state:  # a sharded snapshot, each rank's shards written by itself
            from .sharded import load_dcp

            load_dcp(self.module, self.optimizer, state[DCP_DIR_KEY], state.get(DCP_FILES_KEY))
        elif not (self.sharded and local):
            check_state_compatible(self.module.state_dict(), state["model"], "model")  # global shapes, if sharded
        try:
            if DCP_DIR_KEY in state:
                pass
            elif self.sharded and local:
                from .inplace.hsdp import load_local

                load_local(self.module, self.optimizer, state["model"], state["optimizer"])
            elif self.sharded:
                from .sharded import load_full_state

                load_full_state(self.module, self.optimizer, state["model"], state["optimizer"])
            else:
                self.module.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as e:
            raise ElasticRunError(
                f"snapshot optimizer does not match this optimizer ({e}); resume with the same optimizer "
                "or start with an empty snapshot directory"
            ) from None
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if obj is not None and name in state:
                obj.load_state_dict(state[name])
        try:
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as e:
            raise ElasticRunError(str(e)) from None
        progress = state["progress"]
        self.step, self.samples = int(progress["step"]), int(progress["samples"])
        restore_rng_state(state["rng"])
        self.user.restore(state.get("user"))  # absent: an older snapshot, or nothing registered

"""What ``run.step(loss)`` says about the batch in hand: trained, or abandoned.

A step is abandoned whole when one of its collectives fails (a peer lost): no optimizer
step was taken, the world forms again, and the same samples come back in a later batch
(or were trained by the survivors that completed the step, whose state this rank was
healed to). Code after ``run.step`` that has side effects per step (a log line, a running
sum, a metric) must therefore ask first, or it records a batch that is trained again::

    if run.step(loss):
        log(run.epoch, loss.item())

The result is true exactly when this call trained the batch. Callers that ignore it lose
nothing (it used to be None).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepResult:
    """``trained``: this rank completed the step (its optimizer step was taken).
    ``step``: the step number the batch was for (the run's step count after it, if trained).
    ``epoch``: the epoch the batch belongs to. ``epoch_end``: trained, and it was the last
    step of its epoch (the next batch starts a new one)."""

    trained: bool
    step: int
    epoch: int
    epoch_end: bool = False

    def __bool__(self) -> bool:
        return self.trained


__all__ = ["StepResult"]

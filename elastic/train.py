"""Ready-made elastic runner: ``torchrun ... -m elastic.train --job mlp --snapshot-dir DIR``.

It wires an example job (``elastic.jobs``) into :class:`elastic.trainer.ElasticRun`.
Metrics go to the agent, or under plain torchrun to ``$ELASTIC_METRICS_PORT`` + local rank
(``docs/metrics.md``); ``--no-metrics`` turns them off.
Problems a user can cause end in one ``error:`` line and exit code 2; tracebacks are bugs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Sequence

from . import worker_env
from .jobs import JOBS

if TYPE_CHECKING:
    from .trainer import StepInfo


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m elastic.train", description=__doc__.splitlines()[0])
    p.add_argument("--job", choices=JOBS, required=True)
    p.add_argument("--steps", type=_positive_int, help="stop after this many steps in all")
    p.add_argument("--epochs", type=_positive_int, help="stop after this many epochs (default 1 if no --steps)")
    p.add_argument("--global-batch-size", type=_positive_int, default=32)
    p.add_argument("--batch-policy", choices=("fixed-global", "fixed-per-rank"), default="fixed-global",
                   help="fixed-global (default): same global batch at any world size; fixed-per-rank: "
                        "--per-rank-batch-size per rank, LR scaled by global/--global-batch-size")
    p.add_argument("--per-rank-batch-size", type=_positive_int)
    p.add_argument("--snapshot-dir", default=worker_env.read().node.snapshot_dir,
                   help="shared directory for snapshots (default: $ELASTIC_SNAPSHOT_DIR)")
    p.add_argument("--snapshot-every-steps", type=_non_negative_int, default=100, help="0 turns it off")
    p.add_argument("--snapshot-every-seconds", type=_positive_float)
    p.add_argument("--keep-snapshots", type=_positive_int, default=3)
    p.add_argument("--snapshot-writer", choices=("process", "thread"), default="process",
                   help="rank 0 writes snapshots from a process at idle priority (default) or from a thread")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=_positive_float, help="learning rate (default: the job's)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--collective-timeout", type=_positive_float, default=30.0, metavar="SECONDS")
    p.add_argument("--ledger", help="rank 0 appends one JSON line per committed step (sample ids)")
    p.add_argument("--progress", help="each node's local rank 0 appends one JSON line per step")
    p.add_argument("--data", help="resnet: ImageFolder root (default: FakeData)")
    p.add_argument("--dataset-size", type=_positive_int, help="samples in the synthetic/FakeData dataset")
    p.add_argument("--image-size", type=_positive_int, default=64, help="resnet: image side in pixels")
    p.add_argument("--num-workers", type=_non_negative_int, default=0, help="DataLoader worker processes")
    p.add_argument("--step-sleep", type=float, default=0.0, help="demos/tests: pretend work per step, seconds")
    p.add_argument("--no-metrics", dest="metrics", action="store_false",
                   help="record no Prometheus metrics and install no comm hook (see docs/metrics.md)")
    args = p.parse_args(argv)
    if not args.snapshot_dir:
        p.error("--snapshot-dir is required (or set ELASTIC_SNAPSHOT_DIR)")
    from checkpoints.location import MisspeltLocationError, check_spelling

    try:  # s3:/x: as a directory, the job would snapshot into ./s3:/x/ and exit 0
        check_spelling(args.snapshot_dir)
    except MisspeltLocationError as e:
        p.error(f"--snapshot-dir {e.location}: {e.why}")
    if args.batch_policy == "fixed-per-rank" and not args.per_rank_batch_size:
        p.error("--batch-policy fixed-per-rank needs --per-rank-batch-size")
    if args.data and not Path(args.data).is_dir():
        p.error(f"--data {args.data}: no such directory (an ImageFolder root: one sub-directory per class)")
    if args.steps is None and args.epochs is None:
        args.epochs = 1
    return args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


class _Progress:
    """``--progress``: the per-step JSON lines the tests and the demo read from outside."""

    def __init__(self, path: str | None, restart: int) -> None:
        self.out: IO[str] | None = _append(path, "--progress") if path else None
        self.restart = restart
        self.round = worker_env.read().me.place.round  # set by elastic agent: the rendezvous round

    def __call__(self, info: "StepInfo") -> None:
        if self.out is None:
            return
        self.out.write(json.dumps({
            "node": info.node, "rank": info.rank, "world_size": info.world_size, "step": info.step,
            "epoch": info.epoch, "samples": info.samples, "restart": self.restart, "time": time.time(),
            "loss": float(info.loss), "step_seconds": round(info.step_seconds, 6),
            "round": info.round if info.round >= 0 else self.round, "pid": os.getpid(),
        }) + "\n")
        self.out.flush()


def _append(path: str, flag: str) -> IO[str]:
    from .distributed import ElasticRunError

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        raise ElasticRunError(f"{flag} {path}: cannot append ({e.strerror or e}); pass a writable path") from None


def _configure_logging() -> None:
    # INFO everywhere: ElasticRun itself speaks only from whichever process is rank 0 now,
    # and in place that can change without a restart (rank 0's node lost).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _configure_logging()
    from checkpoints import SnapshotError, SnapshotMismatchError

    from .distributed import ElasticRunError
    from .jobs import build_job
    from .ledger import LedgerError
    from .run_config import DataConfig, SnapshotConfig
    from .trainer import ElasticRun, UsageExit

    env = worker_env.read()
    rank = env.me.place.rank
    try:
        job = build_job(args.job, seed=args.seed, dataset_size=args.dataset_size, data=args.data,
                        image_size=args.image_size)
        optimizer = job.make_optimizer(job.model.parameters(), args.lr or job.default_lr)
        progress = _Progress(args.progress if env.me.local_rank == 0 else None, env.me.restart_count)
        run = ElasticRun(
            job.model, optimizer, job.dataset,
            global_batch_size=args.global_batch_size, snapshot_dir=args.snapshot_dir,
            steps=args.steps, epochs=args.epochs, seed=args.seed,
            snapshots=SnapshotConfig(
                every_steps=args.snapshot_every_steps or None, every_seconds=args.snapshot_every_seconds,
                keep=args.keep_snapshots, writer=args.snapshot_writer, ledger=args.ledger, meta={"job": args.job}),
            data=DataConfig(batch_policy=args.batch_policy, per_rank_batch_size=args.per_rank_batch_size,
                            num_workers=args.num_workers, collate_fn=job.collate_fn),
            backend=args.backend, collective_timeout=args.collective_timeout,
            on_step_end=progress, metrics=args.metrics,
            count_tokens=getattr(job, "tokens", None),  # jobs that define tokens feed elastic_tokens_total
        )
        for batch in run:
            loss = job.loss(run.model, batch)
            run.step(loss)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    except UsageExit:
        raise  # ElasticRun said it in one line already
    except (ElasticRunError, SnapshotError, LedgerError) as e:
        job_wide = isinstance(e, (ElasticRunError, SnapshotMismatchError))  # every rank raises it
        if rank == 0 or not job_wide:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

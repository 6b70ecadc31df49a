"""``python -m checkpoints ls|verify|prune|sign DIR`` - what a person on call needs to see.

Read-only except ``prune`` and ``sign``: the CLI never creates the directory and never
cleans up on its own, so looking cannot change what a running job will find. Every command
judges a snapshot the way resume does (:meth:`SnapshotStore.check`), under the same job key
(``--key-file``, else the rendezvous' ``ELASTIC_RDZV_HMAC_KEY_FILE`` / ``ELASTIC_RDZV_HMAC_KEY``),
so the step the summary says a restart resumes from is the one ``load_latest`` returns, and
``prune`` never removes it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from . import layout, signing
from .errors import ProblemKind, SnapshotError, kind_of
from .store import SnapshotStatus, SnapshotStore, TempDirStatus
from .stores import open_store


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def _age(written_at: float | None, now: float) -> str:
    if written_at is None:
        return "?"
    s = max(0, int(now - written_at))
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s ago"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m ago"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h ago"


def _dir_bytes(path: Path) -> int | None:
    try:
        return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))
    except OSError:  # claimed by a save while we looked
        return None


def _not_a_snapshot_row(path: Path, step: int | None, status: str) -> list[str]:
    """A directory beside the snapshots (a spare, one set aside): its step, size and why."""
    size = _dir_bytes(path)
    return [str(step), "?" if size is None else _size(size), "-", "-", status]


def _rows(statuses: list[SnapshotStatus], temps: list[TempDirStatus], spares: list[Path],
          unsigned_aside: Sequence[Path] = ()) -> list[list[str]]:
    now = time.time()
    newest_valid = max((s.step for s in statuses if s.valid), default=None)
    rows = []
    for s in statuses:
        i = s.info
        if s.valid:
            state = "OK (newest valid)" if s.step == newest_valid else "OK"
        else:
            more = f" (+{len(s.problems) - 1} more)" if len(s.problems) > 1 else ""
            state = f"INVALID: {s.problems[0]}{more}"
        rows.append([
            str(s.step),
            _size(i.size_bytes) if i else "?",
            _age(i.written_at if i else None, now),
            str(i.world_size) if i else "?",
            state,
        ])
    for t in temps:
        what = "stale temp dir (crashed writer; removed by the next save or prune)" if t.stale else "being written"
        rows.append([str(t.step), "-", "-", "-", f"{what}: {t.path.name} pid {t.pid}"])
    for path in spares:
        rows.append(_not_a_snapshot_row(path, layout.parse_spare_dirname(path.name),
                                        "spare: not a snapshot; the next save writes over its files ('prune' deletes it)"))
    for path in unsigned_aside:
        rows.append(_not_a_snapshot_row(
            path, layout.parse_unsigned_dirname(path.name),
            f"set aside: {path.name} was not signed with the job key and its step was written again; "
            "nothing deletes it (delete it by hand)"))
    return rows


def _print_table(rows: list[list[str]]) -> None:
    header = ["STEP", "SIZE", "AGE", "WORLD", "STATUS"]
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(*header)
        for r in rows:
            style = "red bold" if r[4].startswith("INVALID") else ("green" if r[4].startswith("OK") else "yellow")
            table.add_row(*r[:4], Text(r[4], style=style))
        Console().print(table)
        return
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    for r in [header, *rows]:
        print("  ".join(x.rjust(w) if i < 4 else x for i, (x, w) in enumerate(zip(r, widths))).rstrip())


def _summary(statuses: list[SnapshotStatus], root: str) -> str:
    valid = [s for s in statuses if s.valid]
    bad = [s for s in statuses if not s.valid]
    if not statuses:
        return f"no snapshots in {root}"
    head = f"{len(statuses)} snapshot(s), {len(valid)} valid"
    head += f", {len(bad)} INVALID (steps {', '.join(str(s.step) for s in bad)})" if bad else ""
    head += f"; a restart resumes from step {valid[-1].step}" if valid else "; NO valid snapshot - a restart starts from scratch"
    return head


def _signatures(statuses: list[SnapshotStatus], key_from: str | None, root: str) -> str:
    signed = sum(1 for s in statuses if s.signed)
    unsigned = sum(1 for s in statuses if s.signed is False)
    counts = f"{signed} signed, {unsigned} unsigned"
    if key_from is None:
        return (f"signatures: NOT checked (no job key; set {signing.KEY_FILE_ENV} or pass --key-file): {counts}")
    refused = [s for s in statuses if s.problems and kind_of(s.problems[0]) is ProblemKind.SIGNATURE]
    line = f"signatures: checked with the job key from {key_from}: {counts}"
    if refused:
        line += (f"; {len(refused)} refused for their signature (a restart never uses them; "
                 f"if they are this job's own: python -m checkpoints sign {root})")
    return line


def _sign(store: SnapshotStore) -> int:
    """Sign every snapshot that fully verifies and is unsigned; exit 1 if any could not be."""
    failed = 0
    for step in [s.step for s in store.status(full=False)]:
        try:
            done = store.sign_unsigned(step)
        except SnapshotError as e:
            print(f"step {step}: NOT signed: {e}")
            failed += 1
            continue
        print(f"step {step}: {'signed' if done else 'already signed with this key'}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoints", description="Inspect and maintain a snapshot directory.")
    key = argparse.ArgumentParser(add_help=False)
    key.add_argument(
        "--key-file", metavar="PATH",
        help=f"the job key manifests are signed with (default: {signing.KEY_FILE_ENV}, else {signing.KEY_ENV}, "
        "the rendezvous' job key); without one, signatures are not checked",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser(
        "ls", parents=[key],
        help="list snapshots: step, size, age, world size, validity (the one a restart uses is fully "
        "checked, as resume does; older ones by size only)",
    )
    ls.add_argument("dir")
    ls.add_argument("--full", action="store_true", help="fully check every snapshot (slow for big snapshots)")
    ve = sub.add_parser(
        "verify", parents=[key], help="check every file's sha256 and that it loads; exit 1 if any snapshot is invalid"
    )
    ve.add_argument("dir")
    ve.add_argument("--quick", action="store_true", help="check as ls does (sizes only below the newest valid)")
    pr = sub.add_parser(
        "prune", parents=[key], help="remove all but the newest K fully valid snapshots, the spare and stale temp dirs"
    )
    pr.add_argument("dir")
    pr.add_argument("--keep", type=int, default=3, help="snapshots to keep (default 3)")
    sg = sub.add_parser(
        "sign", parents=[key],
        help="sign, with the job key, every unsigned snapshot whose files fully verify (for snapshots written "
        "before the job had a key: only if you trust that nobody else wrote them)",
    )
    sg.add_argument("dir")
    args = p.parse_args(argv)

    try:
        job_key, key_from = signing.load_key(args.key_file)
        # A person pruning wants the space back, so this store keeps no spare.
        store = open_store(args.dir, create=False, recycle=False, key=job_key)
        if args.cmd == "sign":
            if job_key is None:
                print(f"error: no job key to sign with; pass --key-file or set {signing.KEY_FILE_ENV}", file=sys.stderr)
                return 2
            return _sign(store)
        if args.cmd == "prune":
            if args.keep < 1:
                print("error: --keep must be at least 1", file=sys.stderr)
                return 2
            spares = store.drop_spares()
            removed = store.prune(args.keep)
            temps = store.clean_stale_temps()
            for s in removed:
                print(f"removed step {s}")
            for p in spares:
                print(f"removed spare {p.name}")
            for t in temps:
                print(f"removed stale temp dir {t.name}")
            if not removed and not spares and not temps:
                print(f"nothing to prune in {args.dir} (keep={args.keep})")
            statuses = store.status(full=False)
            _print_table(_rows(statuses, store.temp_dirs(), store.spares(), store.set_aside_unsigned()))
            print(_summary(statuses, args.dir))
            print(_signatures(statuses, key_from, args.dir))
            return 0
        full = args.full if args.cmd == "ls" else not args.quick
        statuses = store.status(full=full)
        _print_table(_rows(statuses, store.temp_dirs(), store.spares(), store.set_aside_unsigned()))
        print(_summary(statuses, args.dir))
        print(_signatures(statuses, key_from, args.dir))
        if args.cmd == "verify" and any(not s.valid for s in statuses):
            return 1
        return 0
    except SnapshotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {args.dir}: {e.strerror or e}", file=sys.stderr)
        return 2

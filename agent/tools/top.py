"""``elastic top``: a live terminal view of a running job, from etcd and the nodes' endpoints.

Each refresh lists the live nodes from the registry (so joins and losses show at once),
scrapes every node's ``metrics_url`` in parallel, and shows one row per live rank. Rates
and step-time quantiles cover the time between two refreshes (see ``agent.tools.top_model``), so
``--once`` scrapes twice, ``--interval`` apart, and prints one table. Under it: the job's
goodput since its first step, lost time by cause and the latest fault's phases, read from
the job's goodput record in etcd (``agent.node.goodput``).

No Prometheus is needed; this is the view for a terminal next to the job.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Iterable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from agent.tools.etcd_args import EtcdTarget, add_etcd_arguments, connect
from agent.node.goodput import read_account
from agent.tools.top_model import (DEFAULT_STRAGGLER_RATIO, SPARE, Exposition, JobView, NodeScrape, build_view, fmt_count,
                             fmt_rate, fmt_seconds, goodput_lines)
from agent.etcd import EtcdConfigError, EtcdError
from agent.rendezvous.registry import NodeRecord, list_nodes
from agent.rendezvous.signing import HmacKeyError

DEFAULT_INTERVAL = 2.0
SCRAPE_TIMEOUT = 2.0


def scrape(record: NodeRecord, timeout: float = SCRAPE_TIMEOUT) -> NodeScrape:
    """One node's endpoint now; an unreachable or garbled endpoint is an error, not a crash."""
    at = time.time()
    note = str(record.extra.get("kept_out", ""))  # a node its peers cannot reach says why and for how long
    fault = str(record.extra.get("fault", ""))  # what ended its workers last, kind first (agent.node.fault_cause)
    note = note or (f"last fault: {fault}" if fault else "")
    if not record.metrics_url:
        return NodeScrape(record.node, record.state, at, error="no metrics endpoint", note=note)
    try:
        with urllib.request.urlopen(record.metrics_url, timeout=timeout) as reply:
            text = reply.read().decode("utf-8", errors="replace")
        return NodeScrape(record.node, record.state, at, Exposition.parse(text), note=note)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return NodeScrape(record.node, record.state, at, error=f"scrape failed: {reason}", note=note)


def scrape_all(records: Iterable[NodeRecord], timeout: float = SCRAPE_TIMEOUT) -> dict[str, NodeScrape]:
    records = list(records)
    if not records:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(records))) as pool:
        return {s.node: s for s in pool.map(lambda r: scrape(r, timeout), records)}


class Watcher:
    """Keeps the previous round of scrapes, so each :meth:`poll` can compute rates."""

    def __init__(self, target: EtcdTarget, ratio: float = DEFAULT_STRAGGLER_RATIO) -> None:
        self.target, self.ratio = target, ratio
        self.previous: dict[str, NodeScrape] = {}

    def poll(self) -> JobView:
        t = self.target
        with t.client.deadline(SCRAPE_TIMEOUT):
            records = list_nodes(t.client, t.run_id, t.signer, t.key_prefix)
            account = read_account(t.client, t.signer, t.key_prefix, t.run_id)
        current = scrape_all(records)
        view = replace(build_view(current, self.previous, self.ratio), goodput=account)
        self.previous = current
        return view


def render(view: JobView, run_id: str, note: str = "") -> Group:
    """The table, with the job's totals in its title and stragglers under it."""
    world = "?" if view.world_size is None else str(view.world_size)
    spares = f" ({len(view.spares)} spare)" if view.spares else ""
    title = (f"run {run_id} · world {world} · {len(view.nodes)} nodes{spares} · "
             f"{fmt_rate(view.samples_per_s)} samples · newest snapshot {fmt_seconds(view.snapshot_age_s)} old")
    table = Table(title=title, title_justify="left", expand=False)
    for name, justify in (("node", "left"), ("rank", "right"), ("state", "left"), ("steps", "right"),
                          ("samples/s", "right"), ("step p50", "right"), ("step p99", "right"), ("compute", "right"),
                          ("allreduce/step", "right"), ("busbw", "right"), ("snapshot age", "right"),
                          ("restarts", "right"), ("note", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]  # a str of rich's Literal
    for node in view.nodes:
        if not node.ranks:
            table.add_row(node.node, "-", node.state, *["-"] * 9, node.note or node.error or "no live ranks",
                          style="cyan" if node.state == SPARE else "yellow")  # a spare is ready, not in trouble
        for r in node.ranks:
            # the node's note first: a node kept out is named for why, even if its last pace
            # still flags it a straggler (its row is stale, and the keep-out is the news)
            straggler = f"straggler {r.straggler_ratio:.2f}×" if r.straggler and r.straggler_ratio else ""
            flag = " · ".join(part for part in (node.note, straggler) if part)
            table.add_row(r.node, r.rank, r.state, fmt_count(r.steps), fmt_rate(r.samples_per_s, ""),
                          fmt_seconds(r.step_p50), fmt_seconds(r.step_p99), fmt_seconds(r.compute_s),
                          fmt_seconds(r.allreduce_s_per_step),
                          fmt_rate(r.busbw, "B/s"), fmt_seconds(r.snapshot_age_s), fmt_count(r.restarts),
                          flag, style="bold red" if r.straggler else None)
    parts: list[Table | Text] = [table]
    parts += [Text(line) for line in goodput_lines(view.goodput, time.time())]
    if view.stragglers:
        parts.append(Text(f"stragglers (compute, else step p50, ≥ ratio × median): {', '.join(view.stragglers)}",
                          style="bold red"))
    if not view.nodes:
        parts.append(Text(f"no live nodes registered for run {run_id}", style="yellow"))
    if note:
        parts.append(Text(note, style="yellow"))
    return Group(*parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL,
                        help=f"seconds between refreshes, the window of every rate (default {DEFAULT_INTERVAL})")
    parser.add_argument("--once", action="store_true",
                        help="scrape twice, --interval apart, print one table and exit")
    parser.add_argument("--straggler-ratio", type=float, default=DEFAULT_STRAGGLER_RATIO,
                        help="highlight ranks whose compute per step (else step p50) is this many times the median's "
                             f"(default {DEFAULT_STRAGGLER_RATIO})")
    add_etcd_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.straggler_ratio <= 1:
        print("error: --interval must be > 0 and --straggler-ratio > 1", file=sys.stderr)
        return 2
    try:
        watcher = Watcher(connect(args), args.straggler_ratio)
        view = watcher.poll()
    except (EtcdConfigError, HmacKeyError, argparse.ArgumentTypeError, EtcdError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        if args.once:
            time.sleep(args.interval)
            console.print(render(watcher.poll(), watcher.target.run_id))
            return 0
        return _live(watcher, view, console, args.interval)
    except EtcdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        watcher.target.client.close()


def _live(watcher: Watcher, view: JobView, console: Console, interval: float) -> int:
    run_id = watcher.target.run_id
    with Live(render(view, run_id, "collecting a first window..."), console=console,
              refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                try:
                    view, note = watcher.poll(), ""
                except EtcdError as exc:  # keep the last view; etcd may come back
                    note = f"etcd: {exc}"
                live.update(render(view, run_id, note))
        except KeyboardInterrupt:
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic top", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

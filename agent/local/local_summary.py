"""What ``elastic local`` prints at the end: each fault and what it cost, the last
progress, the job's goodput."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from elastic import contract
from elastic.goodput import Account, describe, newest_account

from agent.local.local_faults import SDC, Cluster, Fault
from agent.local.local_view import say


def job_goodput(cluster: Cluster) -> Account | None:
    """The job's goodput record as the agents last mirrored it (each keeps a copy)."""
    return newest_account(n.node.agent_dir / "goodput" / contract.GOODPUT_JOB_FILE for n in cluster.nodes)


_STARTED_OVER = ("steps rolled back 'up to N': the script reports no step numbers, so each restart started it over "
                 "in a new process; N is what rank 0's process had done, all redone unless the script loads a "
                 "checkpoint of its own (elastic local cannot see that); elastic.report_progress(step) with the "
                 "job's step makes it exact")
_UNKNOWN_NOTE = (" (unknown: after a fault, a redone step cannot be told from a new one for a script that reports "
                 "no step numbers)")


def _rolled_back(fault: Fault, known: bool) -> str:
    if fault.steps_rolled_back is None:
        return "-"
    if known:
        return str(fault.steps_rolled_back)
    return f"up to {fault.step_before}" if fault.started_over else "0"


def summary(console: Console, cluster: Cluster) -> bool:
    """The faults (injected and crashes) and what each cost, the last progress, goodput;
    returns whether every injected fault was recovered from."""
    table = Table(title="Faults and recoveries")
    for col in ("#", "fault", "node", "world before", "recovery s", "steps rolled back"):
        table.add_column(col, justify="right" if col not in ("fault", "node") else "left")
    known = cluster.reports_job_steps()
    faults = sorted(cluster.faults + cluster.crashes, key=lambda f: f.at)
    for i, f in enumerate(faults, 1):
        rec = f"{f.recovery_seconds:.1f}" if f.recovery_seconds is not None else "[red]not seen[/red]"
        table.add_row(str(i), f.kind, f.node, str(f.world_before), rec, _rolled_back(f, known))
    console.print(table)
    for line in _crash_lines(cluster, faults):
        say(console, line)
    for i, f in enumerate(faults, 1):
        if f.kind == SDC:  # silent data corruption: caught by the replica check, or not (yet)
            say(console, f"#{i} sdc {f.node}: caught, {f.note}" if f.recovered_at is not None else
                f"#{i} sdc {f.node}: [red]not caught[/red] (no replica check named a node; does the job run "
                "under ElasticRun with check_every_steps on?)")
    rows = cluster.rows()
    first_loss = next((r["loss"] for r in rows if r.get("loss") is not None), None)  # a script's may start later
    if rows and known and rows[-1].get("loss") is not None:
        say(console, f"final step {rows[-1]['step']} in a world of {rows[-1]['world_size']}, "
                     f"final loss {rows[-1]['loss']:.4g} (first {first_loss:.4g})")
    elif rows and known:
        say(console, f"last step {rows[-1]['step']} in a world of {rows[-1]['world_size']}")
    elif rows:
        say(console, f"last progress in a world of {rows[-1]['world_size']}")
        if any(f.started_over for f in faults):
            say(console, _STARTED_OVER)
    account = job_goodput(cluster)
    unknown = account is not None and account.lost.get("unknown", 0.0) >= 0.05
    say(console, describe(account) + (_UNKNOWN_NOTE if unknown and rows and not known else ""))
    say(console, f"logs and snapshots: {cluster.run_dir}")
    return all(f.recovered_at is not None for f in cluster.faults)


def _crash_lines(cluster: Cluster, faults: list[Fault]) -> list[str]:
    """One line per node and error: which faults (#) it was, the error, and where the log is."""
    logs = {n.node.name: n.node.log_path for n in cluster.nodes}
    seen: dict[tuple[str, str], list[int]] = {}
    for i, f in enumerate(faults, 1):
        for name, crash in f.crashes:
            seen.setdefault((name, crash.describe()), []).append(i)
    return [f"{'#' + ', #'.join(map(str, numbers))} {name}: {what} (log {logs.get(name, '?')})"
            for (name, what), numbers in seen.items()]

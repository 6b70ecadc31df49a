"""The suite's cost and checks: ``python -m tests.support.suite_profile report|asserts``.

``report DIR`` sums what tests/support/profile_plugin.py recorded in DIR (``make
test-profile`` writes it): the totals, the 30 dearest tests by wall and by CPU, and the cost by
kind of test (in-process, etcd, S3 server, agents, network namespaces, Prometheus).

``asserts [--rev REV] [--compare REV]`` lists every test and the checks it makes (its own
``assert`` statements, ``pytest.raises``/``pytest.fail``, and those of the helpers it calls in
its own module, transitively), read from the source with ``ast``. ``--compare REV`` prints
what a change dropped against REV: a test gone, or a check a test no longer makes. A change
that speeds the suite up must leave this empty, or name in its commit where the check lives now.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------- asserts


def _checks_in(node: ast.AST, source: str) -> list[str]:
    found: list[str] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert):
            found.append(" ".join((ast.get_source_segment(source, sub.test) or "?").split()))
        elif isinstance(sub, ast.Call):
            name = ast.unparse(sub.func)
            if name in ("pytest.raises", "pytest.fail", "raises"):
                arg = ast.get_source_segment(source, sub.args[0]) if sub.args else ""
                found.append(f"{name}({' '.join((arg or '').split())})")
    return found


def _called_names(node: ast.AST) -> set[str]:
    return {sub.func.id for sub in ast.walk(node) if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name)}


def module_checks(source: str, path: str) -> dict[str, list[str]]:
    """Each test of one module (``path::name`` or ``path::Class::name``) and its checks."""
    tree = ast.parse(source)
    helpers = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    tests: dict[str, ast.AST] = {}
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test"):
            tests[f"{path}::{n.name}"] = n
        elif isinstance(n, ast.ClassDef) and n.name.startswith("Test"):
            for m in n.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test"):
                    tests[f"{path}::{n.name}::{m.name}"] = m
    result: dict[str, list[str]] = {}
    for name, fn in tests.items():
        checks = _checks_in(fn, source)
        seen: set[str] = set()
        todo = list(_called_names(fn))
        while todo:
            callee = todo.pop()
            if callee in seen or callee not in helpers or callee.startswith("test"):
                continue
            seen.add(callee)
            checks += [f"{callee}: {c}" for c in _checks_in(helpers[callee], source)]
            todo += _called_names(helpers[callee])
        result[name] = checks
    return result


def _test_files(rev: str | None) -> Iterable[tuple[str, str]]:
    if rev is None:
        for p in sorted((ROOT / "tests").rglob("test_*.py")):
            yield str(p.relative_to(ROOT)), p.read_text()
        return
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "tests"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if Path(name).name.startswith("test_") and name.endswith(".py"):
            yield name, subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout


def all_checks(rev: str | None = None) -> dict[str, list[str]]:
    checks: dict[str, list[str]] = {}
    for path, source in _test_files(rev):
        checks.update(module_checks(source, path))
    return checks


def dropped(before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    """Tests gone and checks no longer made, as lines; a test that moved keeps its checks."""
    lines: list[str] = []
    after_anywhere = Counter(c.split(": ", 1)[-1] for cs in after.values() for c in cs)
    for test, checks in sorted(before.items()):
        if test not in after:
            lost = [c for c in checks if after_anywhere[c.split(": ", 1)[-1]] == 0]
            lines.append(f"GONE {test} ({len(checks)} checks, {len(lost)} made nowhere now)")
            lines += [f"    {c}" for c in lost]
            continue
        now = Counter(after[test])
        for c in checks:
            if now[c]:
                now[c] -= 1
            else:
                lines.append(f"LESS {test}: {c}")
    return lines


# ---------------------------------------------------------------------------- report


@dataclass
class TestCost:
    test: str
    wall_s: float
    cpu_s: float
    fixtures: list[str]
    outcome: str
    leftover: list[str]
    started: int = 0
    torch: int = 0
    kinds: set[str] = field(default_factory=set)

    @property
    def kind(self) -> str:
        f = set(self.fixtures)
        if "node_network" in f:
            return "network namespaces"
        if "prometheus" in " ".join(self.fixtures) or "promtool" in self.test:
            return "Prometheus"
        if self.torch >= 2 or "nodes" in f or self.started >= 3:
            return "agents / several torch processes"
        if "s3_server" in f or "bucket" in f:
            return "S3 server"
        if f & {"etcd_server", "etcd_client", "secure_etcd"}:
            return "etcd only"
        if self.started:
            return "one or two processes"
        return "in-process"


def load(out: Path) -> list[TestCost]:
    costs: dict[str, TestCost] = {}
    for f in sorted(out.glob("tests-*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            costs[r["test"]] = TestCost(r["test"], r["wall_s"], r["cpu_s"], r["fixtures"],
                                        r["outcome"], r["leftover_processes"])
    for f in sorted(out.glob("procs-*.log")):
        for line in f.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) < 3 or parts[2] not in costs:
                continue
            event, _, test = parts[:3]
            if event in ("start", "fork"):
                costs[test].started += 1
            elif event == "torch":
                costs[test].torch += 1
    return list(costs.values())


def _row(c: TestCost) -> str:
    return f"| `{c.test}` | {c.wall_s:.1f} | {c.cpu_s:.1f} | {c.started} | {c.torch} | {c.kind} |"


def run_totals(out: Path) -> tuple[float | None, dict | None]:
    """CPU the workers' shared servers used outside any test, and the machine's over the run."""
    outlived = [json.loads(f.read_text())["cpu_s"] for f in sorted(out.glob("outlived-*.json"))]
    machine = out / "machine.json"
    return (sum(outlived) if outlived else None), (json.loads(machine.read_text()) if machine.exists() else None)


def report(costs: list[TestCost], top: int = 30, outlived_s: float | None = None, machine: dict | None = None) -> str:
    head = "| test | wall s | CPU s | processes started | torch imports | kind |\n|---|---:|---:|---:|---:|---|"
    tests_cpu = sum(c.cpu_s for c in costs)
    lines = [
        f"{len(costs)} tests: wall {sum(c.wall_s for c in costs):.0f} s (summed over xdist workers), "
        f"CPU {tests_cpu:.0f} s, processes started {sum(c.started for c in costs)}, "
        f"torch imports {sum(c.torch for c in costs)}, tests that left a process behind "
        f"{sum(1 for c in costs if c.leftover)}",
    ]
    if outlived_s is not None:
        lines.append(f"CPU outside any test (shared servers and the zygote after the test that started them): "
                     f"{outlived_s:.0f} s; the suite's processes in all {tests_cpu + outlived_s:.0f} s")
    if machine is not None:
        lines.append(f"The machine over the run: {machine['wall_s']:.0f} s of wall, {machine['busy_cpu_s']:.0f} s of "
                     f"busy CPU on {machine['cores']} cores (everything on it, pytest itself and any other work)")
    lines += [
        "",
        "By kind:",
        "",
        "| kind | tests | wall s | CPU s | processes | torch imports | median wall s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[str, list[TestCost]] = defaultdict(list)
    for c in costs:
        groups[c.kind].append(c)
    for kind, cs in sorted(groups.items(), key=lambda kv: -sum(c.cpu_s for c in kv[1])):
        lines.append(f"| {kind} | {len(cs)} | {sum(c.wall_s for c in cs):.0f} | {sum(c.cpu_s for c in cs):.0f} | "
                     f"{sum(c.started for c in cs)} | {sum(c.torch for c in cs)} | "
                     f"{statistics.median(c.wall_s for c in cs):.1f} |")
    by_file: dict[str, list[TestCost]] = defaultdict(list)
    for c in costs:
        by_file[c.test.split("::")[0]].append(c)
    lines += ["", f"The {top} dearest files by CPU:", "",
              "| file | tests | wall s | CPU s | processes | torch imports |", "|---|---:|---:|---:|---:|---:|"]
    for path, cs in sorted(by_file.items(), key=lambda kv: -sum(c.cpu_s for c in kv[1]))[:top]:
        lines.append(f"| `{path}` | {len(cs)} | {sum(c.wall_s for c in cs):.0f} | {sum(c.cpu_s for c in cs):.0f} | "
                     f"{sum(c.started for c in cs)} | {sum(c.torch for c in cs)} |")
    lines += ["", f"The {top} dearest tests by CPU:", "", head]
    lines += [_row(c) for c in sorted(costs, key=lambda c: -c.cpu_s)[:top]]
    lines += ["", f"The {top} longest tests by wall time:", "", head]
    lines += [_row(c) for c in sorted(costs, key=lambda c: -c.wall_s)[:top]]
    SESSION_SERVERS = ("etcd", "weed", "prometheus")
    left = [(c.test, p) for c in costs for p in c.leftover if p.strip() and not any(s in p.split(" ")[0] for s in SESSION_SERVERS)]
    if left:
        lines += ["", "Processes that outlived their test (a session's shared servers aside):", ""]
        lines += [f"- `{t}`: `{p}`" for t, p in left]
    failed = [c.test for c in costs if c.outcome not in ("passed", "skipped")]
    if failed:
        lines += ["", "Not passed: " + ", ".join(failed)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.suite_profile")
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="sum a profile directory written by make test-profile")
    r.add_argument("dir", type=Path)
    r.add_argument("--top", type=int, default=30)
    a = sub.add_parser("asserts", help="every test and its checks, or what a change dropped")
    a.add_argument("--rev", help="read the tests at this git revision (default: the work tree)")
    a.add_argument("--compare", metavar="REV", help="print the tests and checks dropped since REV")
    args = parser.parse_args(argv)
    if args.cmd == "report":
        costs = load(args.dir)
        if not costs:
            print(f"error: no test records in {args.dir}; run `make test-profile` first", file=sys.stderr)
            return 2
        print(report(costs, args.top, *run_totals(args.dir)))
        return 0
    if args.compare:
        lines = dropped(all_checks(args.compare), all_checks(args.rev))
        print("\n".join(lines) if lines else f"no test and no check dropped since {args.compare}")
        return 1 if lines else 0
    checks = all_checks(args.rev)
    for test, cs in sorted(checks.items()):
        print(f"{test} ({len(cs)})")
        for c in cs:
            print(f"    {c}")
    print(f"{len(checks)} tests, {sum(len(c) for c in checks.values())} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())

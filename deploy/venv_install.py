"""Install requirements into this interpreter's environment with one pip per core.

Why: pip unpacks one wheel at a time on one core, and torch's CUDA build is a dozen wheels,
2.7 GB compressed: 48 s of a fresh clone's ``make venv`` on 2 cores, one of them idle. pip
resolves the requirements once (``--dry-run --report``, so pip's own resolver and index
settings decide what is installed), then one ``pip install --no-deps`` per core installs its
share, the largest wheels spread first. Wheels are distinct distributions, so the installers
write disjoint files (a namespace folder such as ``nvidia/`` is created by either).

Usage: ``python deploy/venv_install.py torch==2.14.1 torchvision==0.29.1 [-- PIP_OPTIONS]``
(wheels only: an editable project goes after, with a plain pip, as ``make venv`` does).
Anything that keeps the report from being made falls back to one plain ``pip install``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

PIP = [sys.executable, "-m", "pip", "install", "-q", "--no-compile"]


@dataclass(frozen=True)
class Wheel:
    """One distribution pip chose: where it comes from and its size (0 when not a local file)."""

    name: str
    url: str
    size: int


def wheels_of(report: dict) -> list[Wheel]:
    """The distributions a pip ``--report`` says it would install."""
    found = []
    for item in report.get("install", []):
        url = item["download_info"]["url"]
        parsed = urllib.parse.urlparse(url)
        local = Path(urllib.parse.unquote(parsed.path)) if parsed.scheme == "file" else None
        size = local.stat().st_size if local is not None and local.is_file() else 0
        found.append(Wheel(item["metadata"]["name"], url, size))
    return found


def shares(wheels: list[Wheel], n: int) -> list[list[Wheel]]:
    """``wheels`` in at most ``n`` groups of nearly equal bytes: each, largest first, to the
    lightest group so far (unknown sizes count as one byte, so they spread too)."""
    groups: list[list[Wheel]] = [[] for _ in range(max(1, min(n, len(wheels))))]
    loads = [0] * len(groups)
    for wheel in sorted(wheels, key=lambda w: (-w.size, w.name)):
        lightest = loads.index(min(loads))
        groups[lightest].append(wheel)
        loads[lightest] += max(wheel.size, 1)
    return [g for g in groups if g]


def resolve(requirements: list[str], options: list[str]) -> list[Wheel] | None:
    """What pip would install for ``requirements`` (None: pip could not say)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.json"
        done = subprocess.run([*PIP, "--dry-run", "--report", str(path), *options,
                               *requirements], check=False)
        if done.returncode != 0 or not path.is_file():
            return None
        return wheels_of(json.loads(path.read_text()))


def main(argv: list[str]) -> int:
    requirements, options = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    if not requirements:
        print("usage: venv_install.py REQUIREMENT... [-- PIP_OPTIONS]", file=sys.stderr)
        return 2
    wheels = resolve(requirements, options)
    if wheels is None:
        return subprocess.run([*PIP, *options, *requirements], check=False).returncode
    if not wheels:
        return 0  # every requirement is already installed
    cores = len(os.sched_getaffinity(0))
    running = [subprocess.Popen([*PIP, "--no-deps", *options, *(w.url for w in group)])
               for group in shares(wheels, cores)]
    failed = [p.args for p in running if p.wait() != 0]
    if failed:
        print(f"error: pip failed installing {' '.join(str(a) for a in failed[0][len(PIP) + 1:])}; "
              f"run 'make clean venv' to start the environment again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

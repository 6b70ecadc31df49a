"""On-disk naming and the few filesystem primitives that make a snapshot atomic.

A snapshot is the directory ``step-<12 digits>/``. Anything else in the root is a temp
dir (``.tmp-step-...``, leading dot so globbing ``step-*`` can never pick it up), the spare
(``.spare-step-...``: a pruned snapshot whose files the next save overwrites), a
quarantined corrupt snapshot (``.corrupt-step-...``) or one set aside because it was not
signed with the job key (``.unsigned-step-...``: never deleted by the store).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from .pids import pid_alive  # noqa: F401  (its old home: callers import it from here)

MANIFEST_NAME = "MANIFEST.json"
STEP_DIGITS = 12
_MAX_STEP = 10**STEP_DIGITS - 1

_STEP_RE = re.compile(r"^step-(\d{%d})$" % STEP_DIGITS)
_TMP_RE = re.compile(r"^\.tmp-step-(\d{%d})-([0-9a-f]{8})-(\d+)-([0-9a-f]{8})$" % STEP_DIGITS)
_SPARE_RE = re.compile(r"^\.spare-step-(\d{%d})-([0-9a-f]{8})$" % STEP_DIGITS)
_CORRUPT_PREFIX = ".corrupt-step-"
_UNSIGNED_RE = re.compile(r"^\.unsigned-step-(\d{%d})-([0-9a-f]{8})$" % STEP_DIGITS)


def check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
        raise ValueError(f"step must be an int in [0, {_MAX_STEP}], got {step!r}")
    return step


def step_dirname(step: int) -> str:
    return f"step-{check_step(step):0{STEP_DIGITS}d}"


def parse_step_dirname(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def host_tag() -> str:
    """Short stable tag of this host so a pid is only ever judged on the host that owns it."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def temp_dirname(step: int) -> str:
    return f".tmp-{step_dirname(step)}-{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class TempDirName:
    step: int
    host: str
    pid: int


def parse_temp_dirname(name: str) -> TempDirName | None:
    m = _TMP_RE.match(name)
    if not m:
        return None
    return TempDirName(step=int(m.group(1)), host=m.group(2), pid=int(m.group(3)))


def spare_dirname(step: int) -> str:
    """Name for pruned snapshot ``step`` kept for its blocks; never parses as a snapshot."""
    return f".spare-{step_dirname(step)}-{secrets.token_hex(4)}"


def parse_spare_dirname(name: str) -> int | None:
    """The step a spare dir held, or None if ``name`` is not a spare."""
    m = _SPARE_RE.match(name)
    return int(m.group(1)) if m else None


def quarantine_dirname(step: int) -> str:
    return f"{_CORRUPT_PREFIX}{check_step(step):0{STEP_DIGITS}d}-{secrets.token_hex(4)}"


def is_quarantine_dirname(name: str) -> bool:
    return name.startswith(_CORRUPT_PREFIX)


def unsigned_dirname(step: int) -> str:
    """Where a snapshot refused only for its signature goes when its step is written again."""
    return f".unsigned-{step_dirname(step)}-{secrets.token_hex(4)}"


def parse_unsigned_dirname(name: str) -> int | None:
    m = _UNSIGNED_RE.match(name)
    return int(m.group(1)) if m else None


def key_filename(index: int, key: str) -> str:
    """File for one top-level key: index keeps names unique, the sanitised key keeps them readable."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:48].lstrip(".") or "key"
    return f"{index:03d}-{safe}.pt"


# Every name a writer gives a file inside a step: the manifest (and the signing tool's temp
# file beside it), key files (key_filename), and a sharded snapshot's DCP files, part records
# and their temp files (.sharded). Prune and clean-up delete only these: a step directory
# may hold a user's own file (notes, a README), which no tool of this store made.
_STORE_FILE_RE = re.compile(
    r"^(?:%s|\.%s\.signing-\d+|\d{3,}-[A-Za-z0-9_.-]+\.pt|\.metadata|__\d+_\d+\.distcp|\.?part-\d+\.json(?:\.tmp)?)$"
    % (re.escape(MANIFEST_NAME), re.escape(MANIFEST_NAME)))


def is_store_file(name: str) -> bool:
    """Whether ``name`` (one path component) is a file name this store writes in a step."""
    return bool(_STORE_FILE_RE.match(name))


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creates, renames, unlinks) durable, not just its files."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on directories; nothing more we can do
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def thread_nice() -> int:
    """Nice value of the calling thread (Linux: PRIO_PROCESS with who=0 means this thread)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return 0


def set_thread_nice(value: int) -> None:
    """Best effort: lowering the value needs privileges, and only Linux niceness is per thread."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) != value:
            os.setpriority(os.PRIO_PROCESS, 0, value)
    except (AttributeError, OSError):
        pass

"""Node health: what makes a node fail a job later, checked before it joins and while it trains.

A node with a full snapshot disk, no free memory, a clock an hour off, a network interface
that is down or a GPU with pending ECC errors joins a round, and then the whole job pays
for it: a failed snapshot, an OOM kill, a collective that cannot connect. NVRx and DLRover
check such nodes before they take part; so does this agent (``agent.node.health_watch`` runs
the checks at start, before each round and every :data:`INTERVAL_S` while it trains).

Each check is a small function returning a :class:`Check` (what it measured, and the fix
when it failed); the look-ups they need are passed in or cheap (``statvfs``, a 4 KiB
probe file, ``/proc/meminfo``, ``/sys/class/net``, one HTTP request to etcd, one
``nvidia-smi`` query). :func:`verdict` is the decision, pure. A check that cannot tell
(etcd unreachable over HTTP, no ``nvidia-smi``) passes: this module names a sick node, it
does not guess.

Thresholds come from the environment, so an operator can tighten them without a flag:
``ELASTIC_HEALTH_MIN_FREE_MB`` (free space in the snapshot and agent directories, default
1; with two tiers ``DIR,s3://...`` the snapshot directory is the local tier, and the bucket
is asked one HEAD with a 2 s timeout), ``ELASTIC_HEALTH_MIN_MEM_MB`` (``MemAvailable``, default 256),
``ELASTIC_HEALTH_MAX_SKEW_S`` (clock against etcd's, default 10),
``ELASTIC_HEALTH_INTERVAL_S`` (seconds between looks while training, default 30),
``ELASTIC_HEALTH=off`` (no checks at all).
"""

from __future__ import annotations

import email.utils
import errno
import os
import shutil
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from elastic import contract

INTERVAL_S = 30.0  # while training: a look this often (each costs a few ms and one etcd request)
IFF_UP, IFF_RUNNING = 0x1, 0x40


@dataclass(frozen=True)
class Limits:
    min_free_bytes: int = 1 << 20
    min_mem_bytes: int = 256 << 20
    max_skew_s: float = 10.0
    interval_s: float = INTERVAL_S
    enabled: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Limits":
        """The thresholds an operator set; a value that is not a number keeps the default."""
        def number(name: str, default: float) -> float:
            try:
                value = float(env.get(name, ""))
            except ValueError:
                return default
            return value if value >= 0 else default

        return cls(min_free_bytes=int(number(contract.HEALTH_MIN_FREE_ENV, 1) * (1 << 20)),
                   min_mem_bytes=int(number(contract.HEALTH_MIN_MEM_ENV, 256) * (1 << 20)),
                   max_skew_s=number(contract.HEALTH_MAX_SKEW_ENV, 10.0),
                   interval_s=number(contract.HEALTH_INTERVAL_ENV, INTERVAL_S) or INTERVAL_S,
                   enabled=env.get(contract.HEALTH_ENV, "on").lower() not in ("off", "0", "no", "false"))


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``name`` (a metric label), what it saw, and on failure the fix."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"health check {self.name} failed: {self.detail}" + (f"; {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class HealthReport:
    checks: tuple[Check, ...]
    at: float = 0.0

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)


def verdict(report: HealthReport | None) -> str:
    """Why this node must not train now, in one line with the fix; '' for a healthy node (or
    none looked at). Every failed check is named: fixing one to meet the next is slow."""
    if report is None or not report.failed:
        return ""
    return " | ".join(c.line() for c in report.failed)


# ------------------------------------------------------------------------------ the checks


def _mb(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def disk_space(role: str, path: Path, min_free: int, statvfs: Callable[[str], os.statvfs_result] = os.statvfs
               ) -> Check:
    """Free space where ``role`` (the snapshot or the agent directory) writes."""
    try:
        st = statvfs(str(path))
    except OSError as exc:
        return Check(f"{role}_space", False, f"{role} directory {path}: cannot stat it ({exc.strerror})",
                     "create it, or mount the disk that holds it")
    free = st.f_bavail * st.f_frsize
    if free < min_free:
        return Check(f"{role}_space", False,
                     f"{role} directory {path} has {_mb(free)} free of {_mb(st.f_blocks * st.f_frsize)}, under the "
                     f"{_mb(min_free)} needed", "free space on that disk (old snapshots, logs) or give a bigger one "
                     "(ELASTIC_HEALTH_MIN_FREE_MB sets the minimum)")
    return Check(f"{role}_space", True, f"{_mb(free)} free in {path}")


def writable(role: str, path: Path) -> Check:
    """Whether ``role``'s directory takes a small file now: a read-only remount, a full disk
    (ENOSPC) or a lost permission shows here, before a snapshot fails on it."""
    probe = path / f".health-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        why = {errno.ENOSPC: "the disk is full (ENOSPC)", errno.EROFS: "it is read-only (EROFS)",
               errno.EACCES: "permission denied (EACCES)", errno.EDQUOT: "the disk quota is used up (EDQUOT)"}
        return Check(f"{role}_writable", False,
                     f"{role} directory {path} is not writable: {why.get(exc.errno or 0, exc.strerror)}",
                     "free space, remount it read-write or fix its permissions")
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return Check(f"{role}_writable", True, f"{path} is writable")


def reachable(role: str, url: str, probe: Callable[[], None]) -> Check:
    """Whether the object store of ``role`` (an ``s3://`` location, or the second of two tiers)
    answers ``probe`` (one HEAD of the bucket, short timeout): a node that cannot reach it
    would train and then fail every snapshot. ``probe`` raises with the one line to show."""
    try:
        probe()
    except Exception as exc:  # noqa: BLE001 - the probe's own one line (SnapshotDirError), or what stopped it
        return Check(f"{role}_reachable", False, str(exc) or type(exc).__name__,
                     "check the endpoint (AWS_ENDPOINT_URL), the credentials and that the bucket exists")
    return Check(f"{role}_reachable", True, f"{url} answers")


def memory(min_avail: int, meminfo: str) -> Check:
    """``MemAvailable`` (``/proc/meminfo``'s text): a node with none left OOM-kills its workers."""
    for line in meminfo.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "MemAvailable:" and parts[1].isdigit():
            avail = int(parts[1]) * 1024
            if avail < min_avail:
                return Check("memory", False, f"{_mb(avail)} of memory available, under the {_mb(min_avail)} needed",
                             "stop what else runs on this node, or lower ELASTIC_HEALTH_MIN_MEM_MB")
            return Check("memory", True, f"{_mb(avail)} available")
    return Check("memory", True, "MemAvailable not reported: not checked")


def clock(skew: float | None, uncertainty: float, max_skew: float, source: str) -> Check:
    """This node's clock against etcd's (``skew`` = ours - theirs, None: not measured). Only a
    skew beyond ``max_skew`` by more than the measurement's own ``uncertainty`` fails."""
    if skew is None:
        return Check("clock", True, f"not measured ({source})")
    if abs(skew) - uncertainty > max_skew:
        ahead = "ahead of" if skew > 0 else "behind"
        return Check("clock", False, f"this node's clock is {abs(skew):.1f} s {ahead} etcd's ({source}; "
                                     f"±{uncertainty:.1f} s), more than the {max_skew:g} s allowed",
                     "sync it (chronyc makestep, or systemctl restart systemd-timesyncd), or raise "
                     "ELASTIC_HEALTH_MAX_SKEW_S")
    return Check("clock", True, f"{skew:+.1f} s against etcd (±{uncertainty:.1f} s)")


def interface(names: Sequence[str], flags: Callable[[str], int | None],
              chosen_by: Mapping[str, str] | None = None) -> Check:
    """The interfaces the workers bind (the collectives' ``GLOO_SOCKET_IFNAME``, the heals'
    ``ELASTIC_HEAL_IFNAME``): there and up. ``flags(name)``: the interface's flags, None if
    absent; ``chosen_by``: name -> the variable that named it (default GLOO_SOCKET_IFNAME)."""
    if not names:
        return Check("interface", True, "no interface chosen: not checked")
    for name in names:
        value = flags(name)
        if value is None:
            variable = (chosen_by or {}).get(name, "GLOO_SOCKET_IFNAME")
            return Check("interface", False, f"network interface {name} ({variable}) does not exist",
                         "name one that `ip link` lists, or unset it")
        if not value & IFF_UP or not value & IFF_RUNNING:
            return Check("interface", False, f"network interface {name} is down (flags {value:#x})",
                         "bring it up (ip link set dev NAME up) or check its cable or link")
    return Check("interface", True, f"{', '.join(names)} up")


GPU_FIELDS = ("index", "pci.bus_id", "ecc.errors.uncorrected.volatile.total", "retired_pages.pending")


def gpus(csv: str | None, error: str = "") -> Check:
    """``nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader`` read: every device
    answered, none with uncorrected ECC errors since boot or retired pages pending a reset.
    ``csv`` None: no NVIDIA driver here (not checked); ``error``: the query failed."""
    if csv is None and not error:
        return Check("gpu", True, "no nvidia-smi: not checked")
    if error:
        return Check("gpu", False, f"nvidia-smi did not answer: {error}",
                     "reset the GPU (nvidia-smi -r) or drain the node and reboot it")
    bad, seen = [], 0
    for row in csv.splitlines() if csv else []:
        cells = [c.strip() for c in row.split(",")]
        if len(cells) < len(GPU_FIELDS):
            continue
        seen += 1
        index, bus, ecc, pending = cells[:4]
        if ecc.isdigit() and int(ecc) > 0:
            bad.append(f"GPU {index} ({bus}): {ecc} uncorrected ECC error(s)")
        if pending.lower() in ("yes", "1"):
            bad.append(f"GPU {index} ({bus}): retired pages pending")
        if "unknown error" in row.lower() or "gpu is lost" in row.lower():
            bad.append(f"GPU {index} ({bus}): {row.strip()}")
    if bad:
        return Check("gpu", False, "; ".join(bad), "reset the GPU (nvidia-smi -r) to retire the pages, or drain "
                                                   "the node for repair")
    return Check("gpu", True, f"{seen} GPU(s) answered, no pending ECC errors")


# ------------------------------------------------------------------------------ the look-ups


SIOCGIFFLAGS = 0x8913


def net_flags(name: str) -> int | None:
    """The interface's flags as the kernel reports them to ``ip link`` (SIOCGIFFLAGS, in this
    process's network namespace); None if there is no such interface.

    Not ``/sys/class/net/NAME/flags``: that file holds the administrative flags only, never
    IFF_RUNNING (the kernel computes it from the carrier when asked), so every real link read
    as down there; and ``/sys`` shows the namespace it was mounted in, not necessarily ours."""
    import fcntl
    import socket
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            answer = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack("16sH", name.encode()[:15], 0))
    except OSError:
        return None
    return int(struct.unpack("16sH", answer[:18])[1])


def etcd_skew(endpoints: Iterable[tuple[str, int]], cacert: str | None = None, cert: str | None = None,
              key: str | None = None, timeout: float = 2.0,
              now: Callable[[], float] = time.time) -> tuple[float | None, float, str]:
    """(ours - etcd's clock, the measurement's uncertainty, what was asked): one GET of etcd's
    ``/version`` on its client port and the ``Date`` header its HTTP server sets (whole
    seconds, hence ±1 s plus half the round trip). (None, 0, why) where no member answered."""
    context = None
    if cacert:
        context = ssl.create_default_context(cafile=cacert)
        if cert:
            context.load_cert_chain(cert, key)
    scheme = "https" if cacert else "http"
    why = "no etcd endpoint"
    for host, port in endpoints:
        url = f"{scheme}://{host}:{port}/version"
        try:
            sent = now()
            with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
                date = reply.headers.get("Date")
            got = now()
        except (OSError, ValueError) as exc:
            why = f"{url}: {getattr(exc, 'reason', exc)}"
            continue
        if not date:
            why = f"{url} sent no Date header"
            continue
        theirs = email.utils.parsedate_to_datetime(date).timestamp()
        mid = (sent + got) / 2
        # Date truncates to the second: etcd's true time lies in [theirs, theirs + 1)
        return mid - (theirs + 0.5), 0.5 + (got - sent) / 2, f"Date of {url}"
    return None, 0.0, why


def gpu_query(timeout: float = 10.0) -> tuple[str | None, str]:
    """(nvidia-smi's CSV, its error): (None, '') where this node has no NVIDIA driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, ""
    try:
        done = subprocess.run([smi, f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"no answer in {timeout:g} s"
    except OSError as exc:
        return None, str(exc)
    if done.returncode != 0:
        return None, (done.stdout + done.stderr).strip().splitlines()[-1:][0] if (done.stdout + done.stderr).strip() \
            else f"exit {done.returncode}"
    return done.stdout, ""

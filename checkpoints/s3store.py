"""Snapshots in an S3-compatible object store: atomic without rename.

Layout under ``s3://bucket/prefix/``::

    step-<12 digits>/<writer>/<NNN-key>.pt    a writer's files (writer: host tag, pid, random)
    step-<12 digits>/MANIFEST.json            the commit: names its writer's files, written last
    .fence                                    the location's fence (:mod:`.s3fence`)
    .aside/step-<12 digits>-<rand>.json       a refused manifest moved aside when its step is rewritten

Write protocol (a step without a manifest that verifies does not exist, exactly as on disk):
  1. serialise each file to a local spool file while hashing it, upload it under the step
     and this writer's own name (multipart in parallel parts when large);
  2. check the fence, PUT ``MANIFEST.json`` with ``If-None-Match: *`` (a second writer of the
     same step is refused, never overwrites a committed snapshot), check the fence again.
Each writer's files live under its own name, so a stale or racing writer can never write
over the files of a committed snapshot; what it leaves behind is referenced by no manifest,
and prune removes it (and aborts incomplete multipart uploads) once its writer is dead or
the grace period is over, never anything a manifest names. Prune and clean-up delete only
keys this store writes (the manifest; its file names under a writer's name), never a user's
object that happens to lie under a step's prefix.

Reading, verifying, signing and pruning mean exactly what :class:`.store.SnapshotStore`
means by them (same manifest, same signature binding to ``step-<n>``, same loader with
``weights_only=True`` only after the sha256 matched), so resume, ``ls`` and ``prune`` agree.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from . import files, layout, signing
from .errors import (Problem, ProblemKind, SnapshotCorruptError, SnapshotDirError, SnapshotError, SnapshotExistsError,
                     SnapshotKeyError, kind_of)
from .fence import FENCE_NAME, FenceToken
from .location import S3Location, parse_s3
from .manifest import FileEntry, Manifest, ManifestError
from .s3client import PreconditionFailed, S3Objects
from .s3fence import S3Fence, stale_commit
from .s3parts import S3ShardedParts, writer_name
from .reading import FileProblem, SnapshotInfo, SnapshotReader, checked_load
from .reading import info_of as _info
from .reading import signature_only as _signature_only
from .store import TempDirStatus, checked_options
from .tree import check_state
from .workers import DaemonPool

log = logging.getLogger(__name__)

ASIDE = ".aside/"
_WRITER_RE = re.compile(r"^([0-9a-f]{8})-(\d+)-([0-9a-f]{8})$")
_STEP_PREFIX_RE = re.compile(r"^(step-\d{%d})/$" % layout.STEP_DIGITS)


class ObjectPath(str):
    """``s3://bucket/prefix/step-...`` where a Path stands for a directory (``.name`` works)."""

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, other: str) -> "ObjectPath":
        return ObjectPath(f"{self.rstrip('/')}/{other}")


def _writer_gone(writer: str, age_s: float, grace_s: float) -> bool:
    """Whether the files (or upload) of ``writer`` can no longer become part of a snapshot."""
    m = _WRITER_RE.match(writer)
    if m is None:
        return age_s > grace_s
    if m.group(1) == layout.host_tag() and not layout.pid_alive(int(m.group(2))):
        return True
    return age_s > grace_s


def _ours(rel: str) -> bool:
    """Whether ``rel`` (a key relative to its step's prefix) is one this store writes there:
    the manifest, or a file of the store's names under a writer's name. Prune and clean-up
    delete nothing else: another job's prune deleted a user's ``step-.../notes.txt``."""
    if rel == layout.MANIFEST_NAME:
        return True
    writer, sep, name = rel.partition("/")
    return bool(sep) and _WRITER_RE.match(writer) is not None and layout.is_store_file(name)


def _age(when: dt.datetime | None) -> float:
    if when is None:
        return 0.0
    return max(0.0, time.time() - when.timestamp())


class S3SnapshotStore(S3ShardedParts, SnapshotReader):
    """The snapshot store (same interface as :class:`.store.SnapshotStore`) in an object store.

    ``create`` (the writer's side) checks at once that the bucket exists, the credentials are
    accepted, the endpoint answers and the prefix holds nothing this store did not write:
    :class:`SnapshotDirError` with one line otherwise. ``retry_for_s``: how long one
    operation is retried while the server is away before the snapshot fails (training never
    waits for it; the writer skips snapshots due meanwhile); ``timeout_s``: how long one
    request may go unanswered before it counts as a failure (and is retried).
    """

    recycle = False  # no blocks to reuse in an object store
    propagate_nice = False

    def __init__(
        self,
        root: str,
        keep: int = 3,
        *,
        if_exists: Literal["skip", "error"] = "skip",
        create: bool = True,
        io_threads: int = 2,
        stale_temp_grace_s: float = 600.0,
        key: bytes | None | signing._FromEnv = signing.FROM_ENV,
        retry_for_s: float = 300.0,
        timeout_s: float = 60.0,
        multipart_chunk: int = 64 << 20,
        spool_dir: str | None = None,
        **_ignored: Any,  # the local store's knobs (recycle, propagate_nice): nothing to do here
    ) -> None:
        self._key: bytes | None = checked_options(key, keep, if_exists)
        self.loc: S3Location = parse_s3(str(root))
        self.root = ObjectPath(str(self.loc))
        self.keep, self.if_exists, self.stale_temp_grace_s = keep, if_exists, stale_temp_grace_s
        self._io_threads = max(1, io_threads)
        self.retry_for_s = retry_for_s
        self.spool_dir = spool_dir
        self.objects = S3Objects(self.loc, retry_for_s=retry_for_s, timeout_s=timeout_s, multipart_chunk=multipart_chunk)
        self.fence = S3Fence(self.objects, key=self._key)
        self._pool: DaemonPool | None = None
        self._hash_pool: DaemonPool | None = None
        self._pools_lock = threading.Lock()
        self._own: dict[int, str] = {}  # step -> manifest ETag of snapshots this store wrote or fully checked
        self._writing: set[str] = set()  # writer names this process is filling right now
        self._lock = threading.Lock()
        self.objects.probe()
        if create:
            self._check_foreign()

    @property
    def io_threads(self) -> int:
        return self._io_threads

    @property
    def signed(self) -> bool:
        return self._key is not None

    def __repr__(self) -> str:
        return f"S3SnapshotStore({str(self.root)!r}, keep={self.keep})"

    def _check_foreign(self) -> None:
        """Refuse a prefix holding objects this store did not write (another job's, a user's)."""
        for o in self.objects.list():
            k = o["Key"]
            if k == FENCE_NAME or k.startswith(ASIDE) or re.match(r"^step-\d{%d}/" % layout.STEP_DIGITS, k):
                continue
            raise SnapshotDirError(
                f"snapshot location {self.root} holds objects this store did not write (e.g. {k!r}); "
                "give every job a prefix of its own (s3://bucket/some/prefix)")

    # ------------------------------------------------------------------ write

    def _pools(self) -> tuple[DaemonPool, DaemonPool]:
        with self._pools_lock:
            if self._pool is None or self._hash_pool is None:
                self._pool = DaemonPool(self._io_threads, "snapshot-upload")
                self._hash_pool = DaemonPool(self._io_threads, "snapshot-hash")
            return self._pool, self._hash_pool

    def save(self, step: int, state: Mapping[str, Any], *, world_size: int,
             extra_meta: dict[str, Any] | None = None, housekeeping: bool = True) -> SnapshotInfo:
        """Upload ``state`` as snapshot ``step``; committed (its manifest stored) on return."""
        layout.check_step(step)
        check_state(state)
        return self._save(step, world_size, dict(extra_meta or {}), housekeeping,
                          lambda spool, where: self._upload_files(state, spool, where))

    def save_files(self, step: int, src: Path, manifest: Manifest, *, housekeeping: bool = True) -> SnapshotInfo:
        """Upload a committed local snapshot (``src``, its ``manifest``) as snapshot ``step``,
        without serialising anything again: the two-tier save's second tier. Each file's size
        and sha256 are checked against the manifest (hashed as it uploads) before the manifest
        commits it, so only bytes the local tier verified become a snapshot
        (SnapshotCorruptError otherwise, nothing committed)."""
        layout.check_step(step)
        if manifest.step != step:
            raise ValueError(f"manifest of step {manifest.step} given for step {step}")
        return self._save(step, manifest.world_size, dict(manifest.extra_meta), housekeeping,
                          lambda _spool, where: self._upload_copies(src, manifest.files, where))

    def _save(self, step: int, world_size: int, extra_meta: dict[str, Any], housekeeping: bool,
              upload: Callable[[Path, str], list[FileEntry]], writer: str | None = None) -> SnapshotInfo:
        """The commit protocol around ``upload(spool, "<step dir>/<writer>")``, which puts the
        files under the writer's own name and returns their manifest entries (``writer``: the
        name a sharded snapshot's ranks uploaded under, :mod:`.s3parts`)."""
        sdir = layout.step_dirname(step)
        existing = self._handle_existing(step)
        if existing is not None:
            if writer is not None:
                self._delete_quietly([f"{sdir}/{writer}/"])
            return existing
        writer = writer or writer_name()
        with self._lock:
            self._writing.add(writer)
        spool = Path(tempfile.mkdtemp(prefix=".snapshot-spool-", dir=self.spool_dir))
        try:
            entries = upload(spool, f"{sdir}/{writer}")
            manifest = Manifest(step=step, world_size=int(world_size), written_at=time.time(),
                                torch_version=files.torch_version(), files=tuple(entries), extra_meta=extra_meta)
            key = self._key
            data = manifest.to_bytes(None if key is None else lambda body: signing.sign(key, sdir, step, body))
            info = self._commit(step, data, manifest, extra_meta, writer)
        except BaseException:
            self._delete_quietly([f"{sdir}/{writer}/"])
            raise
        finally:
            shutil.rmtree(spool, ignore_errors=True)
            with self._lock:
                self._writing.discard(writer)
        if housekeeping and info.path == self.root / sdir:
            self.housekeep()
        return info

    def _upload_copies(self, src: Path, entries: tuple[FileEntry, ...], where: str) -> list[FileEntry]:
        pool, hash_pool = self._pools()
        rel = where.split("/", 1)[1]

        def one(entry: FileEntry) -> FileEntry:
            # hashed while it uploads (both read the page cache), checked before the manifest
            # commits it: the time is max(hash, upload), not the sum. A file changed in between
            # makes at worst a snapshot that fails its readers' sha256 check, never a wrong load.
            path = src / entry.file
            digest = hash_pool.submit(_file_digest, path)
            try:
                self.objects.upload_file(f"{where}/{entry.file}", str(path))
            finally:
                size, sha = digest.result()
            if size != entry.size or sha != entry.sha256:
                raise SnapshotCorruptError(f"{path}: not the bytes its manifest names (size {size}, manifest says "
                                           f"{entry.size}; sha256 {'ok' if sha == entry.sha256 else 'mismatch'})")
            return FileEntry(key=entry.key, file=f"{rel}/{entry.file}", size=entry.size, sha256=entry.sha256)

        return _all_of([pool.submit(one, e) for e in entries])

    def _upload_files(self, state: Mapping[str, Any], spool: Path, where: str) -> list[FileEntry]:
        pool, hash_pool = self._pools()

        def one(name: str, value: Any) -> tuple[int, str]:
            local = spool / name
            size, sha = _spool_file(local, value, hash_pool)
            self.objects.upload_file(f"{where}/{name}", str(local))
            local.unlink()
            return size, sha

        names = [layout.key_filename(i, k) for i, k in enumerate(state)]
        results = _all_of([pool.submit(one, n, v) for n, v in zip(names, state.values())])
        rel = where.split("/", 1)[1]
        return [FileEntry(key=k, file=f"{rel}/{n}", size=size, sha256=sha)
                for k, n, (size, sha) in zip(state.keys(), names, results)]

    def _commit(self, step: int, data: bytes, manifest: Manifest, extra_meta: dict[str, Any],
                writer: str) -> SnapshotInfo:
        sdir = layout.step_dirname(step)
        token = FenceToken.from_meta(extra_meta.get("fence"))
        if token is not None:
            self.fence.check(token)
        mkey = f"{sdir}/{layout.MANIFEST_NAME}"
        try:
            etag = self.objects.put(mkey, data, if_none_match=True)
        except PreconditionFailed:  # another writer committed this step first: never overwritten
            etag = self._own_commit(mkey, data)
        if etag is None:
            self._delete_quietly([f"{sdir}/{writer}/"])
            existing = self._handle_existing(step)
            if existing is None:
                raise SnapshotError(f"another writer raced us to {self.root / sdir}; retry the save") from None
            return existing
        if token is not None:
            try:
                self.fence.check(token)
            except SnapshotError:
                self._delete_quietly([mkey, f"{sdir}/{writer}/"])  # the fence moved while we committed
                raise
        with self._lock:
            self._own[step] = etag
        return _info(self.root / sdir, manifest)

    def _own_commit(self, mkey: str, data: bytes) -> str | None:
        """The ETag of the manifest at ``mkey`` if it holds exactly ``data``, else None.

        A PUT the server applied but answered with a 5xx (or whose answer was lost) is
        retried, and the retry's If-None-Match then meets our own manifest: the same bytes
        (the signature and ``written_at`` make them this save's alone) mean the commit landed."""
        try:
            stored, etag = self.objects.get(mkey)
        except FileNotFoundError:
            return None
        if stored != data:
            return None
        log.info("%s: the commit landed although its answer was lost; it is this save's", self.root / mkey)
        return etag

    def _handle_existing(self, step: int) -> SnapshotInfo | None:
        """As the local store: keep a valid step (or refuse), set an invalid manifest aside."""
        sdir = layout.step_dirname(step)
        try:
            self.objects.get(f"{sdir}/{layout.MANIFEST_NAME}")
        except FileNotFoundError:
            return None
        problems = self.check(step)
        if not problems:
            if self.if_exists == "error":
                raise SnapshotExistsError(f"snapshot {self.root / sdir} already exists and is valid; snapshots are "
                                          "never overwritten (delete it or use if_exists='skip')")
            log.info("snapshot %s already exists and is valid; keeping it (if_exists='skip')", self.root / sdir)
            return self._info_of(step)
        aside = f"{ASIDE}{sdir}-{secrets.token_hex(4)}.json"
        self.objects.copy(f"{sdir}/{layout.MANIFEST_NAME}", aside)
        self.objects.delete([f"{sdir}/{layout.MANIFEST_NAME}"])
        log.warning("moved invalid snapshot %s's manifest aside to %s (%s) before rewriting it",
                    self.root / sdir, aside, problems[0])
        return None

    def _delete_quietly(self, what: list[str]) -> None:
        """Delete keys, and everything under those ending in '/'; best effort (prune retries)."""
        try:
            keys = []
            for w in what:
                keys += [o["Key"] for o in self.objects.list(w)] if w.endswith("/") else [w]
            self.objects.delete(keys)
        except Exception as e:  # noqa: BLE001 - leftovers are orphans prune removes
            log.info("could not remove %s from %s now (%s); prune will", what, self.root, type(e).__name__)

    def housekeep(self) -> None:
        try:
            self.prune(trust_own=True)
            self.clean_stale_temps()
        except Exception as e:  # noqa: BLE001 - the snapshot is committed; the next save tries again
            log.warning("pruning snapshots in %s failed (the newest snapshot is committed): %s", self.root, e)

    # ------------------------------------------------------------------ read

    def _steps(self) -> list[int]:
        out = []
        for o in self.objects.list(delimiter="/"):
            m = _STEP_PREFIX_RE.match(o.get("Prefix", ""))
            if m:
                step = layout.parse_step_dirname(m.group(1))
                if step is not None:
                    out.append(step)
        return sorted(out)

    def _objects_of(self, step: int) -> dict[str, dict[str, Any]]:
        sdir = layout.step_dirname(step) + "/"
        return {o["Key"][len(sdir):]: o for o in self.objects.list(sdir)}

    def _read_manifest(self, step: int, *, authenticate: bool = True) -> Manifest:
        sdir = layout.step_dirname(step)
        try:
            data, _ = self.objects.get(f"{sdir}/{layout.MANIFEST_NAME}")
        except FileNotFoundError:
            raise ManifestError(f"{layout.MANIFEST_NAME}: missing (the write never finished; this is not a "
                                "snapshot)", ProblemKind.UNFINISHED) from None
        try:
            m = Manifest.from_bytes(data)
        except ManifestError as e:
            raise ManifestError(f"{layout.MANIFEST_NAME}: {e}") from None
        if m.step != step:
            raise ManifestError(f"{layout.MANIFEST_NAME}: records step {m.step} but the directory is {sdir}")
        for f in m.files:
            if f.file.startswith("/") or ".." in f.file.split("/") or f.file == layout.MANIFEST_NAME:
                raise ManifestError(f"{layout.MANIFEST_NAME}: names {f.file!r}, outside its snapshot")
        if authenticate and self._key is not None:
            why = signing.problem(self._key, sdir, m.step, m.signed_bytes, m.signature)
            if why is not None:
                raise ManifestError(f"{layout.MANIFEST_NAME}: {why}", ProblemKind.SIGNATURE)
        return m

    def _info_of(self, step: int) -> SnapshotInfo:
        return self._info_at(step)

    def _quick_check(self, step: int, scan: Any = None) -> tuple[Manifest | None, list[str]]:
        fence: tuple[Any, Any] | None = scan
        objs = self._objects_of(step)
        if layout.MANIFEST_NAME not in objs:
            return None, [Problem(f"{layout.step_dirname(step)}: no such snapshot", ProblemKind.ABSENT)] \
                if not objs else [Problem(f"{layout.MANIFEST_NAME}: missing (the write never finished; this is not "
                                          "a snapshot)", ProblemKind.UNFINISHED)]
        try:
            m = self._read_manifest(step)
        except ManifestError as e:
            return None, [e.problem()]
        current, fence_time = fence if fence is not None else self.fence.stamped()
        why = stale_commit(m.extra_meta.get("fence"), current, fence_time,
                           objs[layout.MANIFEST_NAME].get("LastModified"))
        if why is not None:
            return None, [Problem(f"{layout.MANIFEST_NAME}: {why}", ProblemKind.FENCED)]
        problems = []
        for entry in m.files:
            o = objs.get(entry.file)
            if o is None:
                problems.append(f"{entry.file}: missing (listed in {layout.MANIFEST_NAME})")
            elif int(o["Size"]) != entry.size:
                problems.append(f"{entry.file}: size {o['Size']} bytes, manifest says {entry.size} (truncated or "
                                "overwritten)")
        return m, problems

    def _read_entry(self, step: int, entry: FileEntry, *, map_location: Any, verify: bool) -> Any:
        buf = io.BytesIO()
        try:
            self.objects.download(f"{layout.step_dirname(step)}/{entry.file}", buf)
        except FileNotFoundError:
            raise FileProblem(f"{entry.file}: missing") from None
        return checked_load(buf.getbuffer(), entry, map_location=map_location, verify=verify,
                            corrupted="corrupted or forged")

    # the read side (:class:`.reading.SnapshotReader`) over the object store

    _read_file = _read_entry

    def _bind(self, step: int, entries: list[FileEntry]) -> dict[str, str]:
        """Each DCP file's ETag from one listing, as the load verifies the manifest: every
        ranged read of it (:mod:`.s3dcp`) asks for that object (If-Match), so one replaced
        afterwards is refused. "" for a file missing or of another size now: refused at its
        first read, inside ``dcp.load``, which every rank then fails alike."""
        if not entries:
            return {}
        objs = self._objects_of(step)
        out = {}
        for entry in entries:
            o = objs.get(entry.file)
            out[entry.file] = str(o.get("ETag", "")) if o is not None and int(o["Size"]) == entry.size else ""
        return out

    def _manifest(self, step: int, *, authenticate: bool = True) -> Manifest:
        return self._read_manifest(step, authenticate=authenticate)

    def _scan(self) -> tuple[Any, Any]:
        return self.fence.stamped()  # read once for a walk over all steps

    def _quiet_skip(self, problems: list[str] | tuple[str, ...]) -> bool:
        # a write in progress, a dead writer's leftovers, a pruned step: never a snapshot
        return bool(problems) and kind_of(problems[0]) in (ProblemKind.UNFINISHED, ProblemKind.ABSENT)

    def _status_skip(self, step: int, problems: tuple[str, ...]) -> bool:
        return self._quiet_skip(problems)  # a write in progress or an orphan: temp_dirs() shows it

    # ------------------------------------------------------------------ housekeeping

    def prune(self, keep: int | None = None, *, trust_own: bool = False) -> list[int]:
        """Keep the newest ``keep`` valid snapshots (checked as :meth:`check`; snapshots this
        store wrote only quick-checked with ``trust_own``); delete older ones, manifest first
        so that a half-deleted step is never read. Never the newest valid one; nothing when
        none is valid; never one refused only for its signature."""
        keep = self.keep if keep is None else keep
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        steps = self._steps()
        kept: list[int] = []
        for step in reversed(steps):
            if not self._trusted_problems(step, trust_own):
                kept.append(step)
                if len(kept) == keep:
                    break
        if not kept:
            return []
        doomed = [s for s in steps if s < kept[-1]]
        doomed = [s for s in doomed if not _signature_only(self._quick_check(s)[1])]
        removed = [s for s in doomed if self._remove_step(s)]
        if removed:
            log.info("pruned snapshots %s from %s (keep=%d)", removed, self.root, keep)
        return removed

    def _remove_step(self, step: int) -> bool:
        """Delete what this store wrote under ``step``, manifest first (a half-deleted step is
        never a snapshot); a user's objects stay, named once. False: nothing of ours was there."""
        sdir = layout.step_dirname(step)
        objs = self._objects_of(step)
        ours = [f"{sdir}/{rel}" for rel in objs if _ours(rel)]
        with self._lock:
            self._own.pop(step, None)
        if not ours:
            return False
        manifest = f"{sdir}/{layout.MANIFEST_NAME}"
        self.objects.delete([manifest])
        self.objects.delete([k for k in ours if k != manifest])
        foreign = sorted(rel for rel in objs if not _ours(rel))
        if foreign:
            log.warning("pruned %s but left %d object(s) there that this store did not write (e.g. %r); "
                        "they are yours to keep or delete", self.root / sdir, len(foreign), foreign[0])
        return True

    def _trusted_problems(self, step: int, trust_own: bool) -> list[str]:
        with self._lock:
            own = self._own.get(step)
        if trust_own and own is not None:
            objs = self._objects_of(step)
            man = objs.get(layout.MANIFEST_NAME)
            if man is not None and man.get("ETag") == own:
                return self._quick_check(step)[1]
        problems = self.check(step)
        if not problems:
            man = self._objects_of(step).get(layout.MANIFEST_NAME)
            if man is not None:
                with self._lock:
                    self._own[step] = man.get("ETag", "")
        return problems

    def temp_dirs(self) -> list[TempDirStatus]:
        """Writers' files no manifest names (a write in progress, or a dead writer's orphans)
        and incomplete multipart uploads, one row per (step, writer)."""
        found: dict[tuple[int, str], float] = {}
        for step in self._steps():
            objs = self._objects_of(step)
            named = self._named_files(step, objs)
            for rel, o in objs.items():
                if rel == layout.MANIFEST_NAME or rel in named or not _ours(rel):
                    continue  # a committed file, or nothing a writer of this store left
                w = rel.split("/", 1)[0]
                found[(step, w)] = min(found.get((step, w), 1e18), _age(o.get("LastModified")))
        for u in self.objects.multipart_uploads():
            parts = u["Key"].split("/")
            up_step = layout.parse_step_dirname(parts[0]) if len(parts) == 3 and _ours("/".join(parts[1:])) else None
            if up_step is not None:
                found[(up_step, parts[1])] = min(found.get((up_step, parts[1]), 1e18), _age(u.get("Initiated")))
        out = []
        with self._lock:
            mine = set(self._writing)
        for (step, w), age in sorted(found.items()):
            m = _WRITER_RE.match(w)
            pid = int(m.group(2)) if m else -1
            same_host = m is not None and m.group(1) == layout.host_tag()
            stale = w not in mine and _writer_gone(w, age, self.stale_temp_grace_s)
            out.append(TempDirStatus(self.root / f"{layout.step_dirname(step)}/{w}", step, pid, same_host, stale))
        return out

    def _named_files(self, step: int, objs: Mapping[str, Any]) -> set[str]:
        """The files ``step``'s manifest names (none without one, or with one that does not
        parse): what a writer's leftovers are told apart from."""
        if layout.MANIFEST_NAME not in objs:
            return set()
        try:
            return {f.file for f in self._read_manifest(step, authenticate=False).files}
        except ManifestError:
            return set()

    def clean_stale_temps(self) -> list[ObjectPath]:
        """Delete dead writers' unreferenced files and abort their incomplete multipart uploads;
        never a file a manifest names, never a live writer's."""
        stale = {(t.step, t.path.name) for t in self.temp_dirs() if t.stale}
        if not stale:
            return []
        for u in self.objects.multipart_uploads():
            parts = u["Key"].split("/")
            if len(parts) == 3 and _ours("/".join(parts[1:])) and (layout.parse_step_dirname(parts[0]), parts[1]) in stale:
                self.objects.abort_upload(u["Key"], u["UploadId"])
        removed = []
        for step, w in sorted(stale):
            sdir = layout.step_dirname(step)
            objs = self._objects_of(step)
            named = self._named_files(step, objs)
            doomed = [f"{sdir}/{rel}" for rel in objs if rel.startswith(w + "/") and rel not in named and _ours(rel)]
            self.objects.delete(doomed)
            removed.append(self.root / f"{sdir}/{w}")
        log.info("removed %d dead writer(s)' leftovers (unreferenced objects, incomplete uploads) in %s",
                 len(removed), self.root)
        return removed

    def spares(self) -> list[Path]:
        return []

    def drop_spares(self, keep: int = 0) -> list[Path]:
        return []

    def set_aside_unsigned(self) -> list[Path]:
        return []

    def sign_unsigned(self, step: int) -> bool:
        """As :meth:`.store.SnapshotStore.sign_unsigned`: sign after a full check; the new
        manifest replaces the old only if that one is still the one checked (If-Match)."""
        key = self._key
        if key is None:
            raise SnapshotKeyError(f"no job key to sign with; set {signing.KEY_FILE_ENV} or pass --key-file")
        sdir = layout.step_dirname(step)
        path = self.root / sdir
        try:
            _, etag = self.objects.get(f"{sdir}/{layout.MANIFEST_NAME}")
            m = self._read_manifest(step, authenticate=False)
        except (FileNotFoundError, ManifestError) as e:
            raise SnapshotCorruptError(f"snapshot {path}: {e}") from None
        if m.signature is not None:
            why = signing.problem(key, sdir, m.step, m.signed_bytes, m.signature)
            if why is None:
                return False
            raise SnapshotCorruptError(f"snapshot {path}: {layout.MANIFEST_NAME}: {why} (signed with another key, "
                                       "or forged); not re-signed")
        for entry in m.files:
            try:
                self._read_entry(step, entry, map_location="cpu", verify=True)
            except FileProblem as e:
                raise SnapshotCorruptError(f"snapshot {path}: {e}; not signed") from None
        data = m.to_bytes(lambda body: signing.sign(key, sdir, m.step, body))
        self.objects.put(f"{sdir}/{layout.MANIFEST_NAME}", data, if_match=etag)
        log.info("signed snapshot %s with the job key", path)
        return True


def _all_of(futures: list[Any]) -> list[Any]:
    """Every future's result, in order; the first error re-raised after all have finished."""
    results, first_error = [], None
    for fut in futures:
        try:
            results.append(fut.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below, after all finished
            first_error = first_error or e
    if first_error is not None:
        raise first_error
    return results


def _file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, read once in 8 MB blocks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _spool_file(path: Path, obj: Any, hash_pool: DaemonPool) -> tuple[int, str]:
    """torch.save ``obj`` to a local spool file, hashing the bytes as they are written (no fsync:
    the object store is what must be durable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        w = files._HashingWriter(fd, hash_pool, None)
        try:
            files.save_into(obj, w)
        except RuntimeError:
            if w.os_error is not None:
                raise w.os_error from None
            raise
    finally:
        os.close(fd)
    return w.size, w.sha.hexdigest()

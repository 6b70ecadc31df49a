"""MANIFEST.json: the single source of truth for what a snapshot contains.

The manifest is written last, so its presence means every file it names was fsync'd first.
It carries its own sha256 (over the canonical JSON of everything else) so a flipped byte in
the manifest itself - say in ``world_size`` - is caught even by quick verification.

With a job key it also carries ``hmac`` (:mod:`.signing`), over the canonical JSON of
everything but ``hmac`` and ``manifest_sha256``; the self-checksum covers ``hmac`` too, so a
damaged signature reads as damage and a build without signing still reads the manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import Problem, ProblemKind

FORMAT_NAME = "elastic-trainer-snapshot"
FORMAT_VERSION = 1
_HMAC_RE = re.compile(r"^[0-9a-f]{64}$")


#: Manifest keys of a sharded snapshot's DCP files (:mod:`.sharded`): checked, never loaded by the store.
DCP_PREFIX = "dcp/"


def is_dcp_key(key: str) -> bool:
    return key.startswith(DCP_PREFIX)


class ManifestError(ValueError):
    """The manifest cannot be trusted; the message says why (one line), ``kind`` what it means
    for the snapshot (damage unless the raiser knows better: a signature, a write never finished)."""

    def __init__(self, message: str, kind: ProblemKind = ProblemKind.DAMAGED) -> None:
        super().__init__(message)
        self.kind = kind

    def problem(self) -> Problem:
        return Problem(str(self), self.kind)


@dataclass(frozen=True)
class FileEntry:
    key: str  # top-level key of the saved state
    file: str  # file name inside the snapshot dir
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    written_at: float
    torch_version: str
    files: tuple[FileEntry, ...]
    extra_meta: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # As read from disk: the ``hmac`` field (None if unsigned) and the canonical bytes it signs.
    signature: str | None = field(default=None, compare=False)
    signed_bytes: bytes = field(default=b"", compare=False, repr=False)

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
            "written_at": self.written_at,
            "torch_version": self.torch_version,
            "files": [
                {"key": f.key, "file": f.file, "size": f.size, "sha256": f.sha256} for f in self.files
            ],
            "extra_meta": self.extra_meta,
        }

    def to_bytes(self, sign: Callable[[bytes], str] | None = None) -> bytes:
        """The file's bytes; ``sign`` (canonical body -> hex HMAC) adds the ``hmac`` field."""
        body = self._body()
        if sign is not None:
            body["hmac"] = sign(canonical(body))
        body["manifest_sha256"] = _digest(body)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"not valid JSON ({e.__class__.__name__})") from None
        if not isinstance(body, dict):
            raise ManifestError("not a JSON object")
        recorded = body.pop("manifest_sha256", None)
        if recorded != _digest(body):
            raise ManifestError("self-checksum mismatch (the manifest itself is damaged)")
        signature = body.pop("hmac", None)
        if signature is not None and not (isinstance(signature, str) and _HMAC_RE.match(signature)):
            raise ManifestError("malformed hmac field")
        if body.get("format") != FORMAT_NAME:
            raise ManifestError(f"unknown format {body.get('format')!r}")
        if body.get("format_version") != FORMAT_VERSION:
            raise ManifestError(
                f"format version {body.get('format_version')!r} is not supported "
                f"(this build reads version {FORMAT_VERSION}); upgrade elastic-trainer"
            )
        try:
            files = tuple(
                FileEntry(key=str(f["key"]), file=str(f["file"]), size=int(f["size"]), sha256=str(f["sha256"]))
                for f in body["files"]
            )
            return cls(
                step=int(body["step"]),
                world_size=int(body["world_size"]),
                written_at=float(body["written_at"]),
                torch_version=str(body["torch_version"]),
                files=files,
                extra_meta=dict(body.get("extra_meta") or {}),
                format_version=int(body["format_version"]),
                signature=signature,
                signed_bytes=canonical(body),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"missing or malformed field ({e})") from None


def canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(body)).hexdigest()

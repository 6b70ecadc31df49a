"""The few object-store operations the snapshot store needs, over boto3, with retries.

Why boto3 (docs/checkpoints.md): its transfer manager uploads and downloads large objects
as parallel multipart/ranged transfers (the best a Python client does against one
server), it sends S3's conditional writes (``If-None-Match: *``, ``If-Match``), lists and
aborts incomplete multipart uploads, and it reads credentials and the endpoint from the
standard AWS chain (environment, ``~/.aws/config``, ``AWS_ENDPOINT_URL``, instance roles).
fsspec/s3fs adds a file-system view on top of the same calls that this store does not
want (it would hide rename's absence rather than design around it).

Every call is retried with exponential back-off (tenacity) for up to ``retry_for_s`` when the
server does not answer or answers 5xx; an outage is logged once when it starts and once
when it ends, never per retry. Credentials are never logged (botocore's messages do not
carry them, and nothing here formats them).
"""

from __future__ import annotations

import builtins  # `list` in S3Objects' annotations after its list() method names the method
import logging
import threading
import time
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, wait_exponential, wait_random

from .errors import SnapshotDirError, SnapshotError
from .location import S3Location

log = logging.getLogger(__name__)
# botocore says where it found credentials and the endpoint at INFO on every client; the
# store's own lines say what matters (and a start-up refusal must stay one line).
for _name in ("botocore.credentials", "botocore.configprovider"):
    logging.getLogger(_name).setLevel(logging.WARNING)

T = TypeVar("T")

_TRANSIENT_CODES = frozenset({"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown",
                              "RequestTimeout", "RequestTimeTooSkewed", "OperationAborted"})
_PRECONDITION_CODES = frozenset({"412", "PreconditionFailed", "409", "ConditionalRequestConflict"})
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchUpload"})
_CREDENTIAL_CODES = frozenset({"403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                               "InvalidToken", "ExpiredToken"})


class PreconditionFailed(SnapshotError):
    """A conditional write was refused: the object exists (If-None-Match) or changed (If-Match)."""


def _boto() -> tuple[Any, Any, Any]:
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError:
        raise SnapshotDirError("s3:// snapshot locations need boto3: pip install 'elastic-trainer[s3]'") from None
    return boto3, botocore.config, botocore.exceptions


def error_code(e: BaseException) -> str:
    """S3's error code of a botocore ClientError ("" for anything else)."""
    resp = getattr(e, "response", None)
    if not isinstance(resp, dict):
        return ""
    return str(resp.get("Error", {}).get("Code", "")) or str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def is_transient(e: BaseException) -> bool:
    """Worth retrying: the server did not answer, dropped the connection, or answered 5xx."""
    _, _, exc = _boto()
    if isinstance(e, (exc.EndpointConnectionError, exc.ConnectionClosedError, exc.ConnectTimeoutError,
                      exc.ReadTimeoutError, exc.ResponseStreamingError)):
        return True
    if isinstance(e, exc.ClientError):
        return error_code(e) in _TRANSIENT_CODES
    # the transfer manager wraps a failed part's error in its own exception types
    import boto3.exceptions
    import s3transfer.exceptions

    wrappers = (boto3.exceptions.RetriesExceededError, boto3.exceptions.S3UploadFailedError,
                s3transfer.exceptions.RetriesExceededError, s3transfer.exceptions.S3UploadFailedError)
    return isinstance(e, (ConnectionError, TimeoutError)) or (
        isinstance(e, wrappers)
        and isinstance(e.__cause__ or e.__context__, Exception) and is_transient(e.__cause__ or e.__context__))


def is_missing(e: BaseException) -> bool:
    return error_code(e) in _MISSING_CODES


SILENT_AFTER_S = 10.0  # a request unanswered this long is an outage, though its own timeout is longer


class Progress:
    """A transfer's sign of life: boto3's ``Callback`` for bytes moved. A large upload that moves
    bytes is answered, however long it takes; one that moves none for the silence is not."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self, moved: int) -> None:
        self.last = time.monotonic()



def _raised(rs: RetryCallState) -> BaseException:
    """What the attempt before a retry raised: tenacity sets ``outcome`` before ``before_sleep``,
    and only a raise is retried here (``retry_if_exception``); typed Optional for other hooks."""
    assert rs.outcome is not None
    exc = rs.outcome.exception()
    assert exc is not None
    return exc


class Outage:
    """One line when the server stops answering, one when it is back; nothing per retry.

    A server that refuses connections or answers 5xx is seen at the failed attempt. One that
    accepts and then says nothing (stopped, hung, a black-holed link) fails an attempt only at
    the read timeout, a minute by default, and silently until then: so the requests in flight
    are watched too (:meth:`begin`, :meth:`end`), and one unanswered for ``silent_after_s`` is
    the outage's first line; its answer is the second."""

    def __init__(self, where: str, silent_after_s: float = SILENT_AFTER_S) -> None:
        self.where = where
        self.since: float | None = None
        self.silent_after_s = silent_after_s
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[float, Progress | None]] = {}
        self._tokens = iter(range(1 << 62))
        self._watcher: threading.Thread | None = None

    def begin(self, progress: Progress | None = None) -> int:
        """A request starts; its token for :meth:`end`. ``progress``: a transfer's, whose bytes
        moving count as answers."""
        with self._lock:
            token = next(self._tokens)
            self._inflight[token] = (time.monotonic(), progress)
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch, name="s3-outage-watch", daemon=True)
                self._watcher.start()
        return token

    def end(self, token: int) -> None:
        with self._lock:
            self._inflight.pop(token, None)

    def _watch(self) -> None:
        """Until no request is in flight: name a request unanswered for ``silent_after_s``."""
        while True:
            time.sleep(min(1.0, self.silent_after_s / 4))
            with self._lock:
                if not self._inflight:
                    self._watcher = None
                    return
                waited = time.monotonic() - min(max(start, p.last if p is not None else 0.0)
                                                for start, p in self._inflight.values())
            if waited >= self.silent_after_s:
                self.failed(TimeoutError(f"no answer to a request for {waited:.0f}s"))

    def failed(self, e: BaseException) -> None:
        with self._lock:
            if self.since is not None:
                return
            self.since = time.monotonic()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        log.warning("object store %s does not answer (%s); retrying with back-off - snapshots wait, training "
                    "goes on", self.where, first)

    def answered(self) -> None:
        if self.since is None:  # the common case: no lock taken
            return
        with self._lock:
            since, self.since = self.since, None
        if since is not None:
            log.warning("object store %s answers again after %.0fs", self.where, time.monotonic() - since)


class S3Objects:
    """Objects under one ``s3://bucket/prefix``; keys given to methods are relative to the prefix."""

    def __init__(self, loc: S3Location, *, retry_for_s: float = 300.0, max_concurrency: int = 8,
                 multipart_chunk: int = 64 << 20, timeout_s: float = 60.0,
                 silent_after_s: float = SILENT_AFTER_S) -> None:
        boto3, config, _ = _boto()
        from boto3.s3.transfer import TransferConfig

        self.loc = loc
        self.retry_for_s = retry_for_s
        # botocore retries a little itself (a dropped connection mid-part); tenacity owns the
        # long waits so that an outage is one line, not one per attempt.
        cfg = config.Config(retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=min(5.0, timeout_s), read_timeout=timeout_s,
                            max_pool_connections=max(10, max_concurrency * 2))
        self.client = boto3.session.Session().client("s3", config=cfg)
        self.transfer = TransferConfig(multipart_threshold=multipart_chunk, multipart_chunksize=multipart_chunk,
                                       max_concurrency=max_concurrency, use_threads=True)
        self.outage = Outage(str(loc), silent_after_s)

    # ------------------------------------------------------------------ retries

    def call(self, fn: Callable[[], T], *, retry_for_s: float | None = None, progress: Progress | None = None) -> T:
        """``fn()``, retried with back-off while the server is away (see module docstring);
        ``progress``: the ``Callback`` a transfer in ``fn`` reports its bytes to."""
        limit = self.retry_for_s if retry_for_s is None else retry_for_s
        token = self.outage.begin(progress)
        try:
            for attempt in Retrying(retry=retry_if_exception(is_transient), stop=stop_after_delay(limit),
                                    wait=wait_exponential(multiplier=0.2, max=5.0) + wait_random(0, 0.2), reraise=True,
                                    before_sleep=lambda rs: self.outage.failed(_raised(rs))):
                with attempt:
                    out = fn()
        finally:
            self.outage.end(token)
        self.outage.answered()
        return out

    # ------------------------------------------------------------------ operations

    def put(self, rel: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write ``data``; returns its ETag. PreconditionFailed if the condition does not hold."""
        _, _, exc = _boto()
        kw: dict[str, Any] = {}
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        if if_match is not None:
            kw["IfMatch"] = if_match
        try:
            r = self.call(lambda: self.client.put_object(Bucket=self.loc.bucket, Key=self.loc.key(rel), Body=data,
                                                         **kw))
        except exc.ClientError as e:
            if error_code(e) in _PRECONDITION_CODES:
                raise PreconditionFailed(f"{self.loc.key(rel)}: {error_code(e)}") from None
            raise
        return str(r.get("ETag", ""))

    def upload_file(self, rel: str, filename: str) -> None:
        """Upload a local file, multipart in parallel parts above the threshold."""
        progress = Progress()
        self.call(lambda: self.client.upload_file(filename, self.loc.bucket, self.loc.key(rel), Config=self.transfer,
                                                  Callback=progress), progress=progress)

    def get(self, rel: str) -> tuple[bytes, str]:
        """(bytes, ETag); FileNotFoundError if there is no such object."""
        def fetch() -> tuple[bytes, str]:
            r = self.client.get_object(Bucket=self.loc.bucket, Key=self.loc.key(rel))
            return r["Body"].read(), str(r.get("ETag", ""))
        try:
            return self.call(fetch)
        except Exception as e:
            if is_missing(e):
                raise FileNotFoundError(self.loc.key(rel)) from None
            raise

    def get_range(self, rel: str, start: int, length: int, *, if_match: str | None = None) -> bytes:
        """``length`` bytes at ``start`` of one object (a ranged GET); ``if_match``: only of
        the object with that ETag (PreconditionFailed if it changed since)."""
        _, _, exc = _boto()
        kw: dict[str, Any] = {"Range": f"bytes={start}-{start + length - 1}"}
        if if_match is not None:
            kw["IfMatch"] = if_match

        def fetch() -> bytes:
            body: bytes = self.client.get_object(Bucket=self.loc.bucket, Key=self.loc.key(rel), **kw)["Body"].read()
            return body
        try:
            data = self.call(fetch) if length > 0 else b""
        except exc.ClientError as e:
            if error_code(e) in _PRECONDITION_CODES:
                raise PreconditionFailed(f"{self.loc.key(rel)}: {error_code(e)}") from None
            if is_missing(e):
                raise FileNotFoundError(self.loc.key(rel)) from None
            raise
        if len(data) != length:
            raise SnapshotError(f"{self.loc.key(rel)}: {len(data)} bytes at {start}, not {length} (shorter than its "
                                "record says)")
        return data

    def download(self, rel: str, sink: BinaryIO) -> None:
        """Into ``sink``, as parallel ranged GETs for large objects."""
        progress = Progress()

        def fetch() -> None:
            sink.seek(0)
            sink.truncate()
            self.client.download_fileobj(self.loc.bucket, self.loc.key(rel), sink, Config=self.transfer,
                                         Callback=progress)
        try:
            self.call(fetch, progress=progress)
        except Exception as e:
            if is_missing(e):  # s3transfer's HeadObject answers a missing key with a ClientError, code 404
                raise FileNotFoundError(self.loc.key(rel)) from None
            raise

    def list(self, rel_prefix: str = "", *, delimiter: str = "") -> Iterator[dict[str, Any]]:
        """Objects (``{"Key": rel, "Size", "LastModified", "ETag"}``), or with ``delimiter`` the
        common prefixes as ``{"Prefix": rel}``."""
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.loc.bucket, "Prefix": self.loc.key(rel_prefix)}
            if delimiter:
                kw["Delimiter"] = delimiter
            if token:
                kw["ContinuationToken"] = token
            r = self.call(lambda: self.client.list_objects_v2(**kw))  # noqa: B023 - self.call runs it now
            n = len(self.loc.prefix)
            for o in r.get("Contents", []):
                yield {**o, "Key": o["Key"][n:]}
            for p in r.get("CommonPrefixes", []):
                yield {"Prefix": p["Prefix"][n:]}
            if not r.get("IsTruncated"):
                return
            token = r.get("NextContinuationToken")

    def delete(self, rels: builtins.list[str]) -> None:
        for i in range(0, len(rels), 1000):
            batch = [{"Key": self.loc.key(k)} for k in rels[i:i + 1000]]
            if batch:
                self.call(lambda: self.client.delete_objects(Bucket=self.loc.bucket,
                                                             Delete={"Objects": batch, "Quiet": True}))  # noqa: B023 - self.call runs it now

    def copy(self, src: str, dst: str) -> None:
        self.call(lambda: self.client.copy_object(Bucket=self.loc.bucket, Key=self.loc.key(dst),
                                                  CopySource={"Bucket": self.loc.bucket, "Key": self.loc.key(src)}))

    def multipart_uploads(self) -> builtins.list[dict[str, Any]]:
        """Incomplete multipart uploads under the prefix (``Key`` relative, ``UploadId``, ``Initiated``)."""
        out, kw = [], {"Bucket": self.loc.bucket, "Prefix": self.loc.prefix}
        n = len(self.loc.prefix)
        while True:
            r = self.call(lambda: self.client.list_multipart_uploads(**kw))  # noqa: B023 - self.call runs it now
            out += [{**u, "Key": u["Key"][n:]} for u in r.get("Uploads", [])]
            if not r.get("IsTruncated"):
                return out
            kw = {**kw, "KeyMarker": r.get("NextKeyMarker", ""), "UploadIdMarker": r.get("NextUploadIdMarker", "")}

    def abort_upload(self, rel: str, upload_id: str) -> None:
        try:
            self.call(lambda: self.client.abort_multipart_upload(Bucket=self.loc.bucket, Key=self.loc.key(rel),
                                                                 UploadId=upload_id))
        except Exception as e:
            if not is_missing(e):
                raise

    # ------------------------------------------------------------------ start-up check

    def probe(self) -> None:
        """One attempt, no long retries: SnapshotDirError with one line when the bucket is
        missing, the credentials are refused, or the endpoint does not answer."""
        _, _, exc = _boto()
        where = str(self.loc)
        endpoint = self.client.meta.endpoint_url
        try:
            self.client.head_bucket(Bucket=self.loc.bucket)
        except exc.NoCredentialsError:
            raise SnapshotDirError(f"snapshot location {where}: no S3 credentials found (set AWS_ACCESS_KEY_ID/"
                                   "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)") from None
        except (exc.EndpointConnectionError, exc.ConnectTimeoutError, exc.ReadTimeoutError,
                exc.ConnectionClosedError) as e:
            raise SnapshotDirError(f"snapshot location {where}: the S3 endpoint {endpoint} does not answer "
                                   f"({type(e).__name__}); check AWS_ENDPOINT_URL and that the server is up") from None
        except exc.ClientError as e:
            code = error_code(e)
            if code in _MISSING_CODES or code == "NoSuchBucket":
                raise SnapshotDirError(f"snapshot location {where}: bucket {self.loc.bucket!r} does not exist at "
                                       f"{endpoint}; create it first") from None
            if code in _CREDENTIAL_CODES:
                raise SnapshotDirError(f"snapshot location {where}: the S3 server at {endpoint} refuses these "
                                       f"credentials ({code}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                                       "or AWS_PROFILE") from None
            raise SnapshotDirError(f"snapshot location {where}: the S3 server at {endpoint} answered {code}") from None

"""A real HTTP reverse proxy in front of a real S3 server, told to misbehave on cue.

The S3 tests need a server that answers 500 or 503 SlowDown for a while, or stalls, or
applies a request and then answers 500 as if it had failed: none of which SeaweedFS does on
demand. This proxy (a threaded HTTP/1.1 server on port 0, read back) forwards every request
unchanged - the Host header included, so SigV4 signatures still verify upstream - and can be
told to fail the next N requests, or every request for a time window, optionally only those
matching a method and path fragment. A fault answers with S3's own XML error body, so the
client sees exactly what a real overloaded server sends. Every request is recorded (time,
method, path, what was answered) for the tests to check back-off and what was retried.
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_ERRORS = {500: ("InternalError", "We encountered an internal error. Please try again."),
           503: ("SlowDown", "Please reduce your request rate.")}
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                  "proxy-authorization", "proxy-authenticate",
                  "expect"})  # 100-continue is between the client and us; botocore does not sign it


@dataclass(frozen=True)
class Seen:
    """One request as the proxy saw it, and what it answered (``status``; ``faulted``: by us)."""

    at: float
    method: str
    path: str
    status: int
    faulted: bool


@dataclass
class _Fault:
    status: int  # what to answer (500, 503), or 0 to stall only
    count: int | None  # this many more requests (None: until ``until``)
    until: float | None  # time.monotonic() the window ends (None: until ``count`` is spent)
    method: str | None  # only requests with this method (None: any)
    path_part: str | None  # only requests whose path contains this (None: any)
    after_forward: bool  # apply the request upstream, then answer the fault anyway
    stall_s: float  # hold the request this long before acting on it

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (self.path_part is None or self.path_part in path)

    def live(self, now: float) -> bool:
        return (self.count is None or self.count > 0) and (self.until is None or now < self.until)


class FaultyProxy:
    """``with FaultyProxy(upstream) as p: p.endpoint`` - then ``p.fail_next(..)``/``p.fail_for(..)``."""

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        self.upstream_host, self.upstream_port = u.hostname or "127.0.0.1", u.port or 80
        self.seen: list[Seen] = []
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

            def log_message(self, *args: object) -> None:  # quiet: the tests read ``seen``
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FaultyProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ faults

    def fail_next(self, n: int, status: int = 503, *, method: str | None = None, path_part: str | None = None,
                  after_forward: bool = False, stall_s: float = 0.0) -> None:
        """Answer ``status`` to the next ``n`` (matching) requests."""
        self._add(_Fault(status, n, None, method, path_part, after_forward, stall_s))

    def fail_for(self, seconds: float, status: int = 500, *, method: str | None = None,
                 path_part: str | None = None, stall_s: float = 0.0) -> None:
        """Answer ``status`` (0: answer normally, after ``stall_s``) to every (matching)
        request for ``seconds`` from now: the server down, or slow, for a window."""
        self._add(_Fault(status, None, time.monotonic() + seconds, method, path_part, False, stall_s))

    def heal(self) -> None:
        with self._lock:
            self._faults.clear()

    def _add(self, fault: _Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def _take(self, method: str, path: str) -> _Fault | None:
        now = time.monotonic()
        with self._lock:
            self._faults = [f for f in self._faults if f.live(now)]
            for f in self._faults:
                if f.matches(method, path):
                    if f.count is not None:
                        f.count -= 1
                    return f
        return None

    def faulted(self) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.faulted]

    # ------------------------------------------------------------------ forwarding

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        body = _read_body(h)  # always, so that the connection stays in step even when we fault
        fault = self._take(h.command, h.path)
        if fault is not None and fault.stall_s:
            time.sleep(fault.stall_s)
        headers: list[tuple[str, str]] = []
        status, data, faulted = 0, b"", False
        if fault is None or fault.status == 0 or fault.after_forward:
            status, headers, data = self._forward(h, body)
        if fault is not None and fault.status:
            code, msg = _ERRORS.get(fault.status, ("InternalError", "injected"))
            status, faulted = fault.status, True
            data = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{msg}</Message>'
                    f"<Resource>{h.path}</Resource><RequestId>faulty-proxy</RequestId></Error>").encode()
            headers = [("Content-Type", "application/xml")]
        with self._lock:
            self.seen.append(Seen(time.monotonic(), h.command, h.path, status, faulted))
        h.send_response(status)
        for k, v in headers:
            if k.lower() not in _HOP and k.lower() != "content-length":
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _forward(self, h: BaseHTTPRequestHandler, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=120)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(h.command, h.path, body=body if body or h.command in ("PUT", "POST") else None,
                         headers=headers)
            r = conn.getresponse()
            data = r.read()
            return r.status, r.getheaders(), data
        finally:
            conn.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that gave up on a stall: expected
            super().handle_error(request, client_address)


def _read_body(h: BaseHTTPRequestHandler) -> bytes:
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return bytes(out)
            out += h.rfile.read(size)
            h.rfile.readline()
    n = int(h.headers.get("Content-Length") or 0)
    return h.rfile.read(n) if n else b""

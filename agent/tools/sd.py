"""``elastic sd``: Prometheus http_sd targets listed live from the job's node registry.

Every agent keeps ``{key_prefix}/{run_id}/nodes/{node}`` under a short lease, so the
registry is the list of live nodes. Prometheus polls this server (``http_sd_configs``),
and nodes that join, leave, die or are replaced are followed without editing a file.

Each node with a ``metrics_url`` becomes one target group labelled ``node`` and
``run_id``. If etcd cannot be read, the answer is 503: Prometheus then keeps the targets
it had instead of dropping every node because etcd blinked.

One server can serve several jobs on the same etcd: ``/targets?run_id=RUN`` overrides
``--rdzv-id``. It binds loopback by default: the target list names every training host.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable
from urllib.parse import parse_qs, urlsplit

from agent.tools.etcd_args import EtcdTarget, add_etcd_arguments, connect
from agent.etcd import EtcdConfigError, EtcdError
from agent.rendezvous.registry import NodeRecord, list_nodes
from agent.rendezvous.signing import HmacKeyError

log = logging.getLogger(__name__)

DEFAULT_PORT = 9470
DEFAULT_BIND = "127.0.0.1"
REQUEST_DEADLINE_S = 3.0  # under Prometheus' own http_sd timeout, so a 503 beats a hang
_RUN_ID = re.compile(r"^[A-Za-z0-9_.:-]+$")

TargetGroup = dict[str, Any]


def target_group(record: NodeRecord, run_id: str) -> TargetGroup | None:
    """One http_sd group for a node, or None if it serves no metrics.

    A path other than ``/metrics`` and an https scheme travel as the ``__metrics_path__``
    and ``__scheme__`` labels, which Prometheus uses instead of the scrape config's.
    """
    if not record.metrics_url:
        return None
    url = urlsplit(record.metrics_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        log.warning("node %s: ignoring metrics_url %r (not http(s)://host:port/path)", record.node,
                    record.metrics_url)
        return None
    labels = {"node": record.node, "run_id": run_id}
    if url.path not in ("", "/metrics"):
        labels["__metrics_path__"] = url.path
    if url.scheme == "https":
        labels["__scheme__"] = "https"
    return {"targets": [url.netloc], "labels": labels}


def target_groups(records: Iterable[NodeRecord], run_id: str) -> list[TargetGroup]:
    """The http_sd document for ``records`` (the nodes with metrics), in node order."""
    groups = (target_group(r, run_id) for r in records)
    return [g for g in groups if g is not None]


class _Handler(BaseHTTPRequestHandler):
    server: "SdServer"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        if url.path == "/healthz":
            self._send(HTTPStatus.OK, "ok\n", "text/plain")
            return
        if url.path not in ("/", "/targets"):
            self._send(HTTPStatus.NOT_FOUND, "try /targets\n", "text/plain")
            return
        run_id = (parse_qs(url.query).get("run_id") or [self.server.target.run_id])[0]
        if not run_id or not _RUN_ID.match(run_id):
            self._send(HTTPStatus.BAD_REQUEST, "give ?run_id=RUN or start with --rdzv-id\n", "text/plain")
            return
        try:
            body = json.dumps(self.server.groups(run_id))
        except EtcdError as exc:
            log.warning("cannot list nodes of %s: %s", run_id, exc)
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, f"etcd: {exc}\n", "text/plain")
            return
        self._send(HTTPStatus.OK, body, "application/json")

    def _send(self, status: HTTPStatus, body: str, content_type: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        log.debug("%s %s", self.address_string(), format % args)


class SdServer(ThreadingHTTPServer):
    """The http_sd endpoint over one etcd target; ``serve_forever()`` it, ``shutdown()`` it."""

    daemon_threads = True

    def __init__(self, target: EtcdTarget, bind: str = DEFAULT_BIND, port: int = DEFAULT_PORT) -> None:
        self.target = target
        super().__init__((bind, port), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def groups(self, run_id: str) -> list[TargetGroup]:
        t = self.target
        with t.client.deadline(REQUEST_DEADLINE_S):
            return target_groups(list_nodes(t.client, run_id, t.signer, t.key_prefix), run_id)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port to serve /targets on (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--bind", default=DEFAULT_BIND,
                        help=f"address to listen on (default {DEFAULT_BIND}: only this host's Prometheus)")
    add_etcd_arguments(parser, need_run_id=False)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; one ``error:`` line and exit 2 for bad flags or etcd trouble."""
    if not 0 <= args.port < 65536:
        print(f"error: --port {args.port} is not a port number (0-65535)", file=sys.stderr)
        return 2
    try:
        target = connect(args)
        if target.run_id:  # fail now (within connect_timeout), not at Prometheus' first poll
            list_nodes(target.client, target.run_id, target.signer, target.key_prefix)
    except (EtcdConfigError, HmacKeyError, argparse.ArgumentTypeError, EtcdError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        server = SdServer(target, args.bind, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.bind}:{args.port} ({exc.strerror or exc}); "
              "pick another --port or --bind", file=sys.stderr)
        target.client.close()
        return 2
    where = f"http://{args.bind}:{server.port}/targets"
    print(f"elastic sd: serving Prometheus http_sd targets at {where}"
          + (f" for run {target.run_id}" if target.run_id else " (add ?run_id=RUN)"), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        target.client.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic sd", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

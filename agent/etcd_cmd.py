"""``elastic etcd``: a real etcd in the foreground, for trying the service on one machine."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import Sequence

from elastic.etcd import EmbeddedEtcd


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic etcd", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path(".elastic-etcd"),
                        help="where etcd keeps its data (default ./.elastic-etcd)")
    parser.add_argument("--client-port", type=int, default=2379,
                        help="client port (default 2379; the peer port is the next one; 0 = any free)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    args = parser.parse_args(argv)
    etcd = EmbeddedEtcd(args.data_dir, host=args.host)
    if args.client_port:
        etcd.client_port, etcd.peer_port = args.client_port, args.client_port + 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # before etcd is up: a stop must never be lost
    etcd.start()
    print(f"etcd serving at {etcd.endpoint} (data in {args.data_dir}); Ctrl-C stops it", flush=True)
    print(f"agents: elastic agent --rdzv-endpoint {etcd.endpoint} ...", flush=True)
    try:
        while not stop.wait(0.5):
            if etcd.process is None or etcd.process.poll() is not None:
                print("error: etcd exited; see its log in the data directory", flush=True)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        etcd.stop()  # the data stays: a restart picks the job up where it was
    return 0

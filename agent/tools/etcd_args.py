"""The etcd flags every ``elastic`` tool shares with ``elastic agent``.

Tools take the same ``--rdzv-endpoint``, ``--rdzv-id`` and ``--rdzv-conf`` a user already
passes to the agents (TLS files, user, ``hmac_key_file``, ``key_prefix``), each also read
from ``ELASTIC_RDZV_ENDPOINT``, ``ELASTIC_RDZV_ID`` and ``ELASTIC_RDZV_CONF``; so whatever
reaches the job reaches the tools, with nothing new to learn.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

from elastic import contract
from agent.etcd import EtcdClient, settings_from_options
from agent.rendezvous.registry import NodeRecord, list_nodes
from agent.rendezvous.signing import SignatureError, StateSigner, load_hmac_key

DEFAULT_ENDPOINT = "localhost:2379"


def add_etcd_arguments(parser: argparse.ArgumentParser, *, need_run_id: bool = True) -> None:
    group = parser.add_argument_group("etcd (same as the agents')")
    group.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                       default=os.environ.get(contract.RDZV_ENDPOINT_ENV, DEFAULT_ENDPOINT),
                       help="etcd endpoints, host:port[,host:port...] (env ELASTIC_RDZV_ENDPOINT; "
                            f"default {DEFAULT_ENDPOINT})")
    group.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=os.environ.get(contract.RDZV_ID_ENV),
                       required=need_run_id and not os.environ.get(contract.RDZV_ID_ENV),
                       help="the job's run id (env ELASTIC_RDZV_ID)")
    group.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf",
                       default=os.environ.get(contract.RDZV_CONF_ENV, ""),
                       help="cacert=,cert=,key=,user=,password_file=,hmac_key_file=,key_prefix= "
                            "(env ELASTIC_RDZV_CONF)")


def parse_conf(text: str) -> dict[str, str]:
    """torchrun's ``key=value,key=value`` syntax."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--rdzv-conf item {item!r} is not key=value")
        conf[key.strip()] = value.strip()
    return conf


@dataclass(frozen=True)
class EtcdTarget:
    client: EtcdClient
    signer: StateSigner
    key_prefix: str
    run_id: str


def connect(args: argparse.Namespace) -> EtcdTarget:
    """An etcd client and the job's signer; raises EtcdConfigError/HmacKeyError with one line."""
    conf = parse_conf(args.rdzv_conf)
    settings = settings_from_options(args.rdzv_endpoint, conf)
    client = EtcdClient(settings, retry_deadline=float(conf.get("connect_timeout", 10)))
    signer = StateSigner(load_hmac_key(conf.get("hmac_key_file")))
    return EtcdTarget(client, signer, conf.get("key_prefix", "/elastic").rstrip("/") or "/elastic",
                      args.rdzv_id or "")


class NoLiveNode(Exception):
    """The node a tool was pointed at holds no live lease in the run; the message is its one line."""


def live_node(etcd: EtcdTarget, wanted: str | None) -> tuple[NodeRecord, list[NodeRecord]]:
    """The live node named ``wanted`` (the first in name order when None) and every live node.

    One place for the check each tool makes before it acts, so that every tool refuses a
    name that is not live with the same line, naming the ones that are."""
    nodes = list_nodes(etcd.client, etcd.run_id, etcd.signer, etcd.key_prefix, strict=True)
    if not nodes:
        raise NoLiveNode(f"no live nodes in run {etcd.run_id!r}; check --rdzv-id and --rdzv-endpoint")
    found = nodes[0] if wanted is None else next((n for n in nodes if n.node == wanted), None)
    if found is None:
        raise NoLiveNode(f"no live node {wanted!r} in run {etcd.run_id!r}; live: {', '.join(n.node for n in nodes)}")
    return found, nodes


ANSWER_POLL_S = 0.2


def seconds(text: str) -> float:
    """A ``--timeout`` to wait for a node's answer: above 0, at most an hour."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"give seconds above 0 and at most 3600, not {text!r}")
    return value


def await_answer(etcd: EtcdTarget, key: str, issued_at: float, timeout: float) -> dict[str, object] | None:
    """The signed answer a node's agent put at ``key`` to the command sent at ``issued_at``
    (``elastic check``, ``elastic inject-sdc``); None if none came within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value, _meta = etcd.client.call(lambda c: c.get(key))
        answer = _open(etcd.signer, key, value)
        if answer is not None and answer.get("id") == issued_at:
            return answer
        time.sleep(ANSWER_POLL_S)
    return None


def _open(signer: StateSigner, key: str, value: bytes | None) -> dict[str, object] | None:
    if value is None:
        return None
    try:
        data = json.loads(signer.open(key.encode(), value))
    except (SignatureError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None

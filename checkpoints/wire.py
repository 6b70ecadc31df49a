"""Messages between the trainer and its snapshot writer process: tagged JSON, no pickle.

A job names its tensors by index into the shared staging arena; everything else in the
state (the nesting, numbers, strings, dtypes) is spelled out as ``[tag, value]`` so that
dict vs OrderedDict, tuple vs list and int vs float keys come back exactly. Framing: one
marker byte, then a 4-byte length and the JSON body; ``F`` instead carries file
descriptors (SCM_RIGHTS) for the next message.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

_LEN = struct.Struct("!I")


def encode(obj: Any, tensor_index: Callable[[torch.Tensor], int]) -> Any:
    """``obj`` as JSON-able ``[tag, value]`` trees; tensors become ``["T", index]``."""
    if isinstance(obj, torch.Tensor):
        return ["T", tensor_index(obj)]
    if obj is None:
        return ["N"]
    if isinstance(obj, bool):
        return ["B", obj]
    if isinstance(obj, int):
        return ["I", obj]
    if isinstance(obj, float):
        return ["F", obj]
    if isinstance(obj, complex):
        return ["C", obj.real, obj.imag]
    if isinstance(obj, str):
        return ["S", obj]
    if isinstance(obj, bytes):
        return ["Y", base64.b64encode(obj).decode()]
    if isinstance(obj, torch.dtype):
        return ["DT", str(obj).removeprefix("torch.")]
    if isinstance(obj, torch.device):
        return ["DV", str(obj)]
    if isinstance(obj, torch.Size):
        return ["SZ", list(obj)]
    if isinstance(obj, dict):
        tag = "OD" if isinstance(obj, OrderedDict) else "D"
        return [tag, [[encode(k, tensor_index), encode(v, tensor_index)] for k, v in obj.items()]]
    if isinstance(obj, (list, tuple)):
        return ["L" if isinstance(obj, list) else "U", [encode(v, tensor_index) for v in obj]]
    raise TypeError(f"cannot send a {type(obj).__qualname__} to the writer process")


def decode(obj: Any, tensors: Sequence[torch.Tensor]) -> Any:
    tag = obj[0]
    if tag == "T":
        return tensors[obj[1]]
    if tag == "N":
        return None
    if tag in ("B", "I", "F", "S"):
        return obj[1]
    if tag == "C":
        return complex(obj[1], obj[2])
    if tag == "Y":
        return base64.b64decode(obj[1])
    if tag == "DT":
        dtype = getattr(torch, obj[1])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {obj[1]!r}")
        return dtype
    if tag == "DV":
        return torch.device(obj[1])
    if tag == "SZ":
        return torch.Size(obj[1])
    if tag in ("D", "OD"):
        pairs = ((decode(k, tensors), decode(v, tensors)) for k, v in obj[1])
        return OrderedDict(pairs) if tag == "OD" else dict(pairs)
    if tag in ("L", "U"):
        items = [decode(v, tensors) for v in obj[1]]
        return items if tag == "L" else tuple(items)
    raise ValueError(f"unknown tag {tag!r}")


def send(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    if fds:
        socket.send_fds(sock, [b"F"], list(fds))
    body = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(b"M" + _LEN.pack(len(body)) + body)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Next message and the descriptors sent with it; EOFError when the peer is gone."""
    fds: list[int] = []
    while True:
        marker, got, _flags, _addr = socket.recv_fds(sock, 1, 8)
        fds.extend(got)
        if not marker:
            for fd in fds:
                _close_quietly(fd)
            raise EOFError("writer channel closed")
        if marker == b"M":
            break
        if marker != b"F":
            raise ValueError(f"bad marker {marker!r} on the writer channel")
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return json.loads(_recv_exact(sock, n)), fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("writer channel closed mid-message")
        got += k
    return bytes(buf)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass

"""The bytes hgrt lays out itself, and their checks: the inbox's frames, an inbox's address, a
pipeline stage's spec and its reply, tensors as bytes. Senders and receivers import this module;
a change here is a change of what every board reads.

Version 2 (``VERSION``): an inbox answers a valid token with ``token_ack(token)`` (16 bytes),
so that a sender can tell an hgrt inbox from an unrelated service at that address; what a sender
writes is as in version 1.

- **Inbox connection**: the sender's 16-byte token (answered by the inbox's 16-byte
  acknowledgement, which a sender may wait for), then frames. A frame is ``<q I Q`` (input
  sequence number, header length, payload bytes), a JSON header ``{"name", "dtype", "shape",
  "stream"}``, then the payload (the tensor's bytes, C order). A frame named ``__abort__`` stops
  its stream (payload: why, UTF-8).
- **Inbox address** (what ``hgrt.remote.inbox`` returns): JSON ``{"address", "port", "token"}``,
  the token in hex.
- **Stage spec** (``run_stage``'s argument): JSON ``{"take", "outputs", "stream", "inputs",
  "send", "outbox", "return"}``, optionally ``"timeout"``: the names taken from the inbox, the
  module's output names, the stream, taken names -> input index, the names sent on, the link
  they go through (-1: none), the names returned. An announcement (``announce``'s argument) is
  a stage spec with three keys more, ``"types"`` (name -> ``[dtype, shape]`` of the tensors a
  stage takes that are not inputs of its module), ``"window"`` (how many inputs past the last
  one taken may arrive) and ``"first"`` (the stream's first input): what the stage's inbox
  admits. ``run_stage``'s spec never carries them (its bytes are as before).
- **Stage reply**: the server's seconds from the tensors' arrival to its last send (float64,
  little-endian), then the returned tensors' bytes one after another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from hgrt.errors import InputError, RemoteError

VERSION = 2  # of what is on an inbox connection (see the module doc)
FRAME = struct.Struct("<qIQ")
SECONDS = struct.Struct("<d")
TOKEN_BYTES = 16
MAX_HEADER = 4096
MAX_DIMS = 8
MAX_PAYLOAD = 1 << 32  # bytes of one tensor
DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
          "uint32", "uint64", "bool")
ABORT = "__abort__"  # a frame of this name: the client stopped its stream (payload: why)
NO_LINK = -1  # a stage spec's outbox when the stage sends nothing on
SPEC_NAMES = ("take", "outputs", "send", "return")  # a stage spec's lists of tensor names


class PeerClosed(Exception):
    """The peer closed the connection between two frames."""


class InboxAddress(NamedTuple):
    """Where a session takes tensors from peers, and the token a sender gives first."""

    host: str
    port: int
    token: bytes

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def token_ack(token: bytes) -> bytes:
    """What an inbox answers a sender that gave ``token``: only an inbox knows the token before
    the sender sends it, and no other service computes this from it."""
    return hmac.new(token, b"hgrt inbox", hashlib.sha256).digest()[:TOKEN_BYTES]


# ---- tensors as bytes ----------------------------------------------------------------------
def arrays_to_bytes(arrays: Sequence) -> bytes:
    """The arrays' bytes (C order), one after another."""
    return b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def arrays_from_bytes(data, types, what: str) -> list[np.ndarray]:
    """The arrays that ``data`` (the bytes a server returned) holds one after another, each of
    ``types``' ``(shape, dtype)``: read-only views of ``data``; ``RemoteError`` naming ``what``
    when the byte count is not theirs (a short or long answer is never read as numbers)."""
    want = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in types)
    if len(data) != want:
        raise RemoteError(f"{what} returned {len(data)} bytes for outputs of {want}")
    arrays, at = [], 0
    for shape, dtype in types:
        n = math.prod(shape)
        arrays.append(np.frombuffer(data, np.dtype(dtype), n, at).reshape(shape))
        at += n * np.dtype(dtype).itemsize
    return arrays


# ---- the inbox's frames --------------------------------------------------------------------
def frame_head(seq: int, name: str, arr: np.ndarray, stream: str) -> bytes:
    """The bytes before ``arr``'s payload in the frame of tensor ``name`` of input ``seq``."""
    if arr.dtype.name not in DTYPES:
        raise InputError(f"tensor {name!r}: dtype {arr.dtype} cannot be sent")
    head = json.dumps({"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape),
                       "stream": stream}).encode()
    return FRAME.pack(int(seq), len(head), arr.nbytes) + head


def abort_payload(why: str) -> np.ndarray:
    return np.frombuffer(why.encode(), np.uint8)


def recv_exact(conn: socket.socket, n: int, into: memoryview | None = None,
               frame_start: bool = False) -> memoryview:
    """``n`` bytes from ``conn`` (into ``into``); ``PeerClosed`` when the peer hung up before
    the first byte of a frame, ``EOFError`` when it did within one."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = conn.recv_into(buf[got:], n - got)
        if k == 0:
            if frame_start and got == 0:
                raise PeerClosed()
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_by(conn: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes from ``conn`` before ``deadline`` (``time.monotonic()``), however they
    trickle in: a ``TimeoutError`` past it, a ``ConnectionError`` when the peer hangs up (both
    ``OSError``s)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(buf)} of {n} bytes came before the deadline")
        conn.settimeout(left)
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class FrameHead(NamedTuple):
    seq: int
    stream: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def parse_frame_head(prefix: bytes, header: bytes) -> FrameHead:
    """The checked head of a frame: ``prefix`` (``FRAME.size`` bytes) and its JSON ``header``;
    ``InputError`` saying what is wrong with it."""
    seq, hlen, nbytes = FRAME.unpack(prefix)
    if hlen != len(header):
        raise InputError(f"frame header of {len(header)} bytes, announced {hlen}")
    try:
        head = json.loads(header)
        name, dtype, shape = str(head["name"]), str(head["dtype"]), tuple(head["shape"])
        stream = str(head.get("stream", ""))
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise InputError(f"frame header is not {{name, dtype, shape}} JSON: {e}") from None
    if dtype not in DTYPES:
        raise InputError(f"tensor {name!r}: dtype {dtype!r} is not one of {DTYPES}")
    if len(shape) > MAX_DIMS or not all(isinstance(d, int) and 0 <= d <= MAX_PAYLOAD
                                        for d in shape):
        raise InputError(f"tensor {name!r}: shape {list(shape)[:9]} is not a list of sizes")
    want = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes != want or nbytes > MAX_PAYLOAD:
        raise InputError(f"tensor {name!r}: {nbytes} payload bytes for {dtype}{list(shape)} "
                         f"({want} bytes; at most {MAX_PAYLOAD})")
    return FrameHead(seq, stream, name, dtype, shape, nbytes)


def read_frame_head(conn: socket.socket) -> FrameHead:
    """The next frame's head from ``conn`` (its payload follows); ``PeerClosed`` between
    frames."""
    prefix = bytes(recv_exact(conn, FRAME.size, frame_start=True))
    hlen = FRAME.unpack(prefix)[1]
    if hlen > MAX_HEADER:
        raise InputError(f"frame header of {hlen} bytes (at most {MAX_HEADER})")
    return parse_frame_head(prefix, bytes(recv_exact(conn, hlen)))


def read_payload(conn: socket.socket, head: FrameHead) -> np.ndarray:
    arr = np.empty(head.shape, head.dtype)
    recv_exact(conn, head.nbytes, memoryview(arr.reshape(-1).view(np.uint8)))
    return arr


# ---- an inbox's address --------------------------------------------------------------------
def inbox_address_json(address: str, port: int, token: bytes) -> str:
    return json.dumps({"address": address, "port": port, "token": token.hex()})


def parse_inbox_address(text: str, host: str | None = None) -> InboxAddress:
    """The address in ``hgrt.remote.inbox``'s answer; ``host`` replaces the address the server
    saw itself at (a client reaches it where it connected)."""
    try:
        where = json.loads(str(text))
        token = bytes.fromhex(where["token"])
        port = int(where["port"])
        address = host or str(where["address"])
    except (ValueError, KeyError, TypeError) as e:
        raise RemoteError(f"the server described its inbox as {str(text)[:80]!r} ({e})") from e
    if len(token) != TOKEN_BYTES:
        raise RemoteError(f"an inbox token is {TOKEN_BYTES} bytes, the server gave "
                          f"{len(token)}")
    return InboxAddress(address, port, token)


# ---- a pipeline stage ----------------------------------------------------------------------
def stage_spec(take: Sequence[str], outputs: Sequence[str], stream: str,
               inputs: Mapping[str, int], send: Sequence[str], outbox: int,
               returns: Sequence[str]) -> dict:
    """A stage spec, its keys in wire order (``encode_stage_spec`` writes them so)."""
    return {"take": list(take), "outputs": list(outputs), "stream": stream,
            "inputs": dict(inputs), "send": list(send), "outbox": int(outbox),
            "return": list(returns)}


def announcement(spec: Mapping, types: Mapping[str, tuple[str, Sequence[int]]], window: int,
                 first: int) -> dict:
    """``spec`` with what its stage's inbox is to admit: ``types`` of the taken tensors that are
    not the module's inputs (the server knows those), ``window`` inputs ahead, from ``first``."""
    return {**spec, "types": {n: [str(d), [int(x) for x in shape]]
                              for n, (d, shape) in types.items()},
            "window": int(window), "first": int(first)}


def decode_announcement(spec: Mapping) -> tuple[dict[str, tuple[str, tuple[int, ...]]], int, int]:
    """``(types, window, first)`` of a decoded announcement; ``InputError`` saying what is wrong
    with them."""
    try:
        types, window, first = spec["types"], spec["window"], spec["first"]
        if not isinstance(types, dict) or not all(isinstance(v, list) and len(v) == 2
                                                  for v in types.values()):
            raise TypeError("types is not a map of names to [dtype, shape]")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (window, first)):
            raise TypeError("window and first are not integers")
        out = {}
        for name, (dtype, shape) in types.items():
            if dtype not in DTYPES or not isinstance(shape, list) or len(shape) > MAX_DIMS \
                    or not all(isinstance(d, int) and 0 <= d <= MAX_PAYLOAD for d in shape) \
                    or math.prod(shape) * np.dtype(dtype).itemsize > MAX_PAYLOAD:
                raise TypeError(f"tensor {name!r}: {dtype!r}{shape!r} is not a tensor type")
            out[str(name)] = (dtype, tuple(shape))
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"announce: a bad announcement ({e})") from None
    return out, window, first


def encode_stage_spec(spec: Mapping) -> str:
    return json.dumps(dict(spec))


def decode_stage_spec(text: str) -> dict:
    """The checked stage spec in ``text``; ``InputError`` saying what is wrong with it."""
    try:
        spec = json.loads(str(text))
        for key in SPEC_NAMES:
            if not isinstance(spec[key], list) or not all(isinstance(n, str) for n in spec[key]):
                raise TypeError(f"{key} is not a list of names")
        if not isinstance(spec["inputs"], dict) or not set(spec["inputs"]) <= set(spec["take"]):
            raise TypeError("inputs is not a map of taken names to input indices")
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"run_stage: a bad stage description ({e})") from None
    return spec


def encode_stage_reply(seconds: float, arrays: Sequence) -> bytes:
    return SECONDS.pack(float(seconds)) + arrays_to_bytes(arrays)


def decode_stage_reply(data, what: str) -> tuple[float, bytes]:
    """``(seconds, the returned tensors' bytes)`` of a stage reply."""
    data = bytes(data)
    if len(data) < SECONDS.size:
        raise RemoteError(f"{what} returned {len(data)} bytes, not a stage reply")
    return SECONDS.unpack_from(data)[0], data[SECONDS.size:]

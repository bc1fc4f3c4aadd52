"""Tensors from board to board without the client: an RPC session's inbox, a plain TCP socket
beside the session's TVM RPC connection.

TVM RPC carries a tensor's bytes at about 50 MiB/s on loopback (2.4 MiB in 46-50 ms, the client's
CPU busy throughout; a plain socket moves the same bytes in about 1.3 ms on the same machine).
A pipeline's stages therefore pass their tensors through inboxes: the client sends the model's
inputs to the inbox of the first stage that reads them, each stage sends what later stages read
to the next stage's inbox, and only the last stage's outputs come back through RPC. TVM RPC stays
the control path: it creates the inbox, hands out its port and token, and starts each stage.

An inbox listens on the address its session was reached at, serves only the peers the server's
``--allow`` admits and that first send its 16-byte token (handed out through the session), and
checks every frame (the frame format: ``hgrt.rpc.wire``). A stream is one pipeline's inputs: an
abort stops one stream and drops what it sent, never another's.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from hgrt.errors import InputError, RemoteError
from hgrt.rpc import wire

MAX_READERS = 64  # connections an inbox serves at once
SESSION_ADDRESS = "127.0.0.1"  # where a session's inbox listens: set to the address its RPC
#                               connection was reached at, in each session process
SESSION_ALLOWED: Callable[[str], bool] = lambda host: True  # noqa: E731 - the server's --allow
TAKE_TIMEOUT = 60.0  # seconds a stage waits for its tensors before saying which did not come
SEND_TIMEOUT = 60.0  # seconds a send may block on a peer that stopped reading


def read_frame(conn: socket.socket) -> tuple[int, str, str, np.ndarray]:
    """The next frame from ``conn``: ``(seq, stream, name, array)``."""
    head = wire.read_frame_head(conn)
    return head.seq, head.stream, head.name, wire.read_payload(conn, head)


class Inbox:
    """Where a session's tensors arrive, by stream, input sequence number and name."""

    def __init__(self, address: str = "127.0.0.1") -> None:
        self.token = secrets.token_bytes(wire.TOKEN_BYTES)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.create_server((address, 0), family=family)
        self.address, self.port = self._sock.getsockname()[:2]
        self._items: dict[tuple[str, int], dict[str, np.ndarray]] = {}
        self._cond = threading.Condition()
        self._lost: str | None = None  # every sender hung up: why nothing more comes
        self._aborted: dict[str, str] = {}  # stream -> why its client stopped it
        self._senders = 0
        self._readers = threading.BoundedSemaphore(MAX_READERS)
        threading.Thread(target=self._accept_loop, daemon=True, name="hgrt-inbox").start()

    def describe(self) -> str:
        return wire.inbox_address_json(self.address, self.port, self.token)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            if not SESSION_ALLOWED(peer[0]) or not self._readers.acquire(blocking=False):
                conn.close()  # not a peer the server serves, or too many at once
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name="hgrt-inbox-reader").start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            with conn:
                try:
                    conn.settimeout(10.0)
                    if not hmac.compare_digest(bytes(wire.recv_exact(conn, wire.TOKEN_BYTES)),
                                               self.token):
                        return  # not a sender this RPC session handed its token to
                    conn.settimeout(None)
                except (OSError, EOFError):
                    return
                self._read_all(conn, peer)
        finally:
            self._readers.release()

    def _read_all(self, conn: socket.socket, peer) -> None:
        with self._cond:
            self._senders += 1
            self._lost = None  # a sender is here again
        why = None
        try:
            while True:
                seq, stream, name, arr = read_frame(conn)
                with self._cond:
                    if name == wire.ABORT:
                        self._aborted[stream] = arr.tobytes().decode(errors="replace")
                        for key in [k for k in self._items if k[0] == stream]:
                            del self._items[key]  # what it sent will never be taken
                    elif stream not in self._aborted:
                        self._items.setdefault((stream, seq), {})[name] = arr
                    self._cond.notify_all()
        except wire.PeerClosed:
            pass
        except Exception as e:  # noqa: BLE001 - a broken stream: say why, keep the inbox
            why = f"{peer[0]}:{peer[1]}: {type(e).__name__}: {e}"
        finally:
            with self._cond:
                self._senders -= 1
                if why is not None:  # the first broken stream says why nothing more comes
                    self._lost = self._lost or why
                elif self._senders == 0 and self._lost is None:
                    self._lost = f"the sender at {peer[0]}:{peer[1]} closed its connection"
                self._cond.notify_all()

    def take(self, seq: int, names: list[str], timeout: float = TAKE_TIMEOUT,
             stream: str = "") -> dict:
        """The tensors ``names`` of input ``seq`` of ``stream``, removed from the inbox; waits
        for them."""
        deadline = time.monotonic() + timeout
        key = (stream, seq)
        with self._cond:
            while True:
                have = self._items.get(key, {})
                missing = [n for n in names if n not in have]
                if not missing:
                    got = {n: have.pop(n) for n in names}
                    if not have:
                        self._items.pop(key, None)
                    return got
                if stream in self._aborted:
                    raise RemoteError(f"input {seq}: stopped before {missing} came: "
                                      f"{self._aborted[stream]}")
                if self._lost is not None and not self._senders:
                    raise RemoteError(f"input {seq}: {missing} never came: {self._lost}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RemoteError(f"input {seq}: {missing} did not come within {timeout:g} s")
                self._cond.wait(left)

    def pending(self) -> int:
        with self._cond:
            return sum(len(v) for v in self._items.values())

    def close(self) -> None:
        self._sock.close()


class Outbox:
    """A connection to another RPC session's inbox; ``send`` is thread-safe."""

    def __init__(self, host: str, port: int, token: bytes, timeout: float = 10.0) -> None:
        if len(token) != wire.TOKEN_BYTES:
            raise InputError(f"an inbox token is {wire.TOKEN_BYTES} bytes, got {len(token)}")
        self.where = f"{host}:{port}"
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
            self._sock.settimeout(SEND_TIMEOUT)  # a peer that stops reading fails the send
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            self._sock.sendall(token)
        except OSError as e:
            raise RemoteError(f"cannot reach the inbox at {self.where}: {e}") from e
        self._lock = threading.Lock()

    def send(self, seq: int, name: str, value: np.ndarray, stream: str = "") -> None:
        arr = np.ascontiguousarray(value)
        head = wire.frame_head(seq, name, arr, stream)
        with self._lock:
            try:
                self._sock.sendall(head)
                self._sock.sendall(memoryview(arr.reshape(-1).view(np.uint8)))
            except OSError as e:
                raise RemoteError(f"sending {name!r} of input {seq} to the inbox at "
                                  f"{self.where} failed: {e}") from e

    def abort(self, why: str, stream: str = "") -> None:
        """Stop ``stream`` at the receiving session: its stage that waits for tensors fails
        with ``why``, and what the stream sent there is dropped."""
        self.send(-1, wire.ABORT, wire.abort_payload(why), stream)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

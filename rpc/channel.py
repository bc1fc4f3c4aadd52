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

An inbox takes only what its stages announced (``Inbox.announce``: a stage spec through
``hgrt.remote`` before the stream starts, or a stage's own ``take``): for each tensor name of a
stream its dtype and shape, and how many inputs ahead of the last one taken may arrive. So what
a stream holds is at most that window times the announced bytes.
"""

from __future__ import annotations

import collections
import errno
import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from hgrt.errors import InputError, RemoteError
from hgrt.rpc import wire

MAX_READERS = 64  # senders an inbox serves at once
MAX_PENDING = 64  # connections that have not given the token yet
HANDSHAKE_TIMEOUT = 5.0  # seconds a connection has, in all, to give the token
WINDOW = 256  # inputs ahead of the last one taken that an announcement may admit
ANNOUNCE_TIMEOUT = 10.0  # seconds a frame may wait for its stage's announcement
MAX_HELD = 1 << 30  # bytes an inbox holds at once (a sender beyond waits)
MAX_STREAMS = 1024  # streams remembered: above, the finished ones are forgotten
ACCEPT_BACKOFF = 0.05  # seconds the accept loop pauses after a failed accept (no descriptors)
SESSION_ADDRESS = "127.0.0.1"  # where a session's inbox listens: set to the address its RPC
#                               connection was reached at, in each session process
SESSION_ALLOWED: Callable[[str], bool] = lambda host: True  # noqa: E731 - the server's --allow
TAKE_TIMEOUT = 60.0  # seconds a stage waits for its tensors before saying which did not come
SEND_TIMEOUT = 60.0  # seconds a send may block on a peer that stopped reading


Announced = tuple[str, tuple[int, ...]] | None  # (dtype, shape); None: any (a bare take)


def read_frame(conn: socket.socket) -> tuple[int, str, str, np.ndarray]:
    """The next frame from ``conn``: ``(seq, stream, name, array)``."""
    head = wire.read_frame_head(conn)
    return head.seq, head.stream, head.name, wire.read_payload(conn, head)


class _Stream:
    """One stream's state in an inbox."""

    __slots__ = ("items", "held", "senders", "lost", "aborted", "taken", "expects", "window")

    def __init__(self) -> None:
        self.items: dict[int, dict[str, np.ndarray]] = {}  # seq -> name -> tensor
        self.held = 0  # bytes in items, and admitted ones on their way
        self.senders = 0  # open connections that sent this stream a frame
        self.lost: str | None = None  # its last sender hung up: why nothing more comes (once
        #                               no sender at all is connected: the client aborts a
        #                               stream whose board is lost while it is)
        self.aborted: str | None = None  # its client stopped it: why
        self.taken: dict[str, int] = {}  # name -> the last input it was taken for: a stage
        #                                  takes in order, so never for an earlier one again
        self.expects: dict[str, Announced] = {}  # name -> what its stage announced
        self.window: dict[str, int] = {}  # name -> inputs after ``taken`` that may arrive


class Inbox:
    """Where a session's tensors arrive, by stream, input sequence number and name.

    What a peer can make it hold is bounded: a connection has ``HANDSHAKE_TIMEOUT`` seconds in
    all to give the token, at most ``MAX_PENDING`` connections wait for theirs (a new one
    closes the oldest), ``MAX_READERS`` senders are served at once. A frame is admitted only
    for a tensor a stage announced (``announce``), of its dtype and shape, for an input within
    the announced window past the last one taken: a stream holds at most window x announced
    bytes. A frame that comes before its announcement waits for it (its payload unread) for
    ``ANNOUNCE_TIMEOUT`` seconds; past ``MAX_HELD`` bytes in all a sender waits, as TCP makes
    it, until a stage takes. A frame that breaks the rules (malformed, not announced, another
    type, past the window, a tensor sent twice, an input already taken) closes its own
    connection, the reason kept in ``refused``, nothing else."""

    def __init__(self, address: str = "127.0.0.1") -> None:
        self.token = secrets.token_bytes(wire.TOKEN_BYTES)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.create_server((address, 0), family=family)
        self.address, self.port = self._sock.getsockname()[:2]
        self._streams: dict[str, _Stream] = {}
        self._held = 0
        self._senders = 0  # connections that gave the token and are open
        self._door = 0  # frames waiting for their stage's announcement
        self._cond = threading.Condition()
        self._closed = False
        self._pending: dict[socket.socket, float] = {}  # connections yet to give the token
        self._readers = threading.BoundedSemaphore(MAX_READERS)
        self.refused: collections.deque[str] = collections.deque(maxlen=16)  # latest, why
        threading.Thread(target=self._accept_loop, daemon=True, name="hgrt-inbox").start()

    def describe(self) -> str:
        return wire.inbox_address_json(self.address, self.port, self.token)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError as e:  # out of descriptors, a connection reset before accept
                if self._closed or e.errno in (errno.EBADF, errno.EINVAL):
                    return
                time.sleep(ACCEPT_BACKOFF)
                continue
            if not SESSION_ALLOWED(peer[0]):
                conn.close()  # not a peer the server serves
                continue
            with self._cond:
                if len(self._pending) >= MAX_PENDING:  # the oldest silent one makes room
                    oldest = min(self._pending, key=self._pending.get)
                    del self._pending[oldest]
                    _shut(oldest)
                self._pending[conn] = time.monotonic()
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name="hgrt-inbox-reader").start()

    def _serve(self, conn: socket.socket, peer) -> None:
        with conn:
            try:
                token = wire.recv_by(conn, wire.TOKEN_BYTES, time.monotonic() + HANDSHAKE_TIMEOUT)
            except (OSError, EOFError):
                return
            finally:
                with self._cond:
                    self._pending.pop(conn, None)
            if not hmac.compare_digest(token, self.token):
                return  # not a sender this RPC session handed its token to
            if not self._readers.acquire(blocking=False):
                self.refused.append(f"{peer[0]}:{peer[1]}: {MAX_READERS} senders already")
                return
            try:
                conn.settimeout(HANDSHAKE_TIMEOUT)
                conn.sendall(wire.token_ack(self.token))  # the sender may check it is us
                conn.settimeout(None)
                self._read_all(conn, peer)
            except OSError:
                return
            finally:
                self._readers.release()

    def _read_all(self, conn: socket.socket, peer) -> None:
        sent: set[str] = set()  # the streams this connection sent frames of
        why = None
        with self._cond:
            self._senders += 1
        try:
            while True:
                head = wire.read_frame_head(conn)
                st = self._admit(head, sent)
                try:
                    arr = wire.read_payload(conn, head)
                except BaseException:
                    self._release(st, head)
                    raise
                self._store(st, head, arr)
        except wire.PeerClosed:
            pass
        except Exception as e:  # noqa: BLE001 - a broken connection: say why, keep the inbox
            why = f"{peer[0]}:{peer[1]}: {type(e).__name__}: {e}"
            self.refused.append(why)
        finally:
            with self._cond:
                self._senders -= 1
                for name in sent:
                    st = self._streams[name]
                    st.senders -= 1
                    if st.senders == 0 and st.lost is None:
                        st.lost = why or f"the sender at {peer[0]}:{peer[1]} closed its " \
                                         f"connection"
                self._cond.notify_all()

    def announce(self, stream: str, types: Mapping[str, Announced], window: int,
                 first: int = 0) -> None:
        """Admit tensors ``types`` (name -> ``(dtype, shape)``, or None: any) of ``stream``,
        from input ``first`` on and at most ``window`` inputs ahead of the last one taken.
        Announcing a name again changes nothing; with another type it is an ``InputError``."""
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= WINDOW:
            raise InputError(f"stream {stream!r}: a window of {window!r} inputs (1 to {WINDOW})")
        with self._cond:
            st = self._streams.get(stream)
            if st is None:
                if len(self._streams) >= MAX_STREAMS:
                    self._forget_streams()
                st = self._streams[stream] = _Stream()
            for name, want in types.items():
                if name in st.expects:
                    if st.expects[name] != want:
                        raise InputError(f"tensor {name!r} of stream {stream!r}: announced as "
                                         f"{_typed(st.expects[name])}, now {_typed(want)}")
                    continue
                st.expects[name] = want
                st.window[name] = window
                st.taken.setdefault(name, int(first) - 1)
            self._cond.notify_all()

    def _announced(self, head: wire.FrameHead) -> _Stream:
        """The stream of ``head`` once a stage announced its tensor (or, for an abort, any);
        waits up to ``ANNOUNCE_TIMEOUT`` for that (the caller holds ``_cond``)."""
        deadline = time.monotonic() + ANNOUNCE_TIMEOUT
        while True:
            st = self._streams.get(head.stream)
            if st is not None and (head.name in st.expects
                                   or head.name == wire.ABORT and st.expects):
                return st
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                raise InputError(f"tensor {head.name!r} of input {head.seq} of stream "
                                 f"{head.stream!r}: no stage announced it")
            self._door += 1
            try:
                self._cond.wait(left)
            finally:
                self._door -= 1

    def _admit(self, head: wire.FrameHead, sent: set[str]) -> _Stream:
        """The stream of ``head``, room for its payload reserved; waits while the inbox is
        full. ``InputError`` for a frame that is not what its stage announced."""
        with self._cond:
            st = self._announced(head)
            if head.name == wire.ABORT:
                if head.nbytes > wire.MAX_HEADER:
                    raise InputError(f"an abort of {head.nbytes} bytes")
                return self._sender_of(st, head, sent)
            want = st.expects[head.name]
            if want is not None and (head.dtype, head.shape) != want:
                raise InputError(f"tensor {head.name!r} of input {head.seq}: "
                                 f"{_typed((head.dtype, head.shape))}, announced {_typed(want)}")
            last = st.taken[head.name]
            if head.seq <= last:
                raise InputError(f"input {head.seq} of this stream was already taken")
            if head.seq > last + st.window[head.name]:
                raise InputError(f"input {head.seq}: beyond the announced window (inputs "
                                 f"{last + 1} to {last + st.window[head.name]})")
            if head.name in st.items.get(head.seq, ()):
                raise InputError(f"tensor {head.name!r} of input {head.seq} was sent twice")
            deadline = time.monotonic() + TAKE_TIMEOUT
            while self._held and self._held + head.nbytes > MAX_HELD:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise InputError(f"input {head.seq}: the inbox stayed full for "
                                     f"{TAKE_TIMEOUT:g} s")
                self._cond.wait(left)
            st.items.setdefault(head.seq, {})
            st.held += head.nbytes
            self._held += head.nbytes
            return self._sender_of(st, head, sent)

    @staticmethod
    def _sender_of(st: _Stream, head: wire.FrameHead, sent: set[str]) -> _Stream:
        """Count the connection among ``st``'s senders once a frame of it was admitted (a
        refused one never makes its stream lost)."""
        if head.stream not in sent:
            sent.add(head.stream)
            st.senders += 1
            st.lost = None  # a sender is here again
        return st

    def _release(self, st: _Stream, head: wire.FrameHead) -> None:
        """Give back the room ``_admit`` reserved for a frame that did not come."""
        if head.name == wire.ABORT:
            return
        with self._cond:
            st.held -= head.nbytes
            self._held -= head.nbytes
            if st.items.get(head.seq) == {}:
                del st.items[head.seq]
            self._cond.notify_all()

    def _store(self, st: _Stream, head: wire.FrameHead, arr: np.ndarray) -> None:
        with self._cond:
            if head.name == wire.ABORT:
                st.aborted = arr.tobytes().decode(errors="replace")
                stored = sum(a.nbytes for got in st.items.values() for a in got.values())
                st.held -= stored  # what it sent will never be taken
                self._held -= stored
                st.items.clear()
            elif st.aborted is None:
                st.items.setdefault(head.seq, {})[head.name] = arr
            else:
                st.held -= head.nbytes
                self._held -= head.nbytes
            self._cond.notify_all()

    def _forget_streams(self) -> None:
        """Drop the streams that hold nothing and have no sender (finished pipelines)."""
        for name in [n for n, st in self._streams.items() if not st.items and not st.senders]:
            del self._streams[name]

    def take(self, seq: int, names: list[str], timeout: float = TAKE_TIMEOUT,
             stream: str = "", types: Mapping[str, Announced] | None = None,
             window: int = WINDOW) -> dict:
        """The tensors ``names`` of input ``seq`` of ``stream``, removed from the inbox; waits
        for them. Names no stage announced are announced here, from input ``seq`` on: as
        ``types`` says (a name it lacks is not), or as any tensor when ``types`` is None."""
        deadline = time.monotonic() + timeout
        with self._cond:
            st = self._streams.get(stream)
            new = [n for n in names if st is None or n not in st.expects]
            if new:
                self.announce(stream, {n: None if types is None else types[n] for n in new
                                       if types is None or n in types}, window, seq)
            st = self._streams.setdefault(stream, _Stream())
            while True:
                have = st.items.get(seq, {})
                missing = [n for n in names if n not in have]
                if not missing:
                    got = {n: have.pop(n) for n in names}
                    freed = sum(a.nbytes for a in got.values())
                    st.held -= freed
                    self._held -= freed
                    if not have:
                        st.items.pop(seq, None)
                    for n in names:
                        st.taken[n] = max(st.taken.get(n, -1), seq)
                    self._cond.notify_all()
                    return got
                if st.aborted is not None:
                    raise RemoteError(f"input {seq}: stopped before {missing} came: "
                                      f"{st.aborted}")
                if st.lost is not None and not st.senders and not self._senders:
                    raise RemoteError(f"input {seq}: {missing} never came: {st.lost}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RemoteError(f"input {seq}: {missing} did not come within {timeout:g} s")
                self._cond.wait(left)

    def pending(self) -> int:
        """Frames in the inbox: held, on their way, or waiting for their announcement."""
        with self._cond:
            return self._door + sum(len(v) for st in self._streams.values()
                                    for v in st.items.values())

    def held_bytes(self) -> int:
        """Bytes of tensors the inbox holds (and admitted ones on their way)."""
        with self._cond:
            return self._held

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for conn in list(self._pending):
                _shut(conn)
            self._cond.notify_all()
        self._sock.close()


def _typed(t: Announced) -> str:
    return "any tensor" if t is None else f"{t[0]}{list(t[1])}"


def _shut(conn: socket.socket) -> None:
    """Wake a thread blocked reading ``conn``: its read ends (its thread closes it)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass




class Outbox:
    """A connection to another RPC session's inbox; ``send`` is thread-safe."""

    def __init__(self, host: str, port: int, token: bytes, timeout: float = 10.0,
                 verify: bool = False) -> None:
        """``verify``: wait (up to ``HANDSHAKE_TIMEOUT``) for the inbox's acknowledgement of
        the token; a ``RemoteError`` when what answers at that address is not the inbox (an
        unrelated service on a tunnel's local port, say)."""
        if len(token) != wire.TOKEN_BYTES:
            raise InputError(f"an inbox token is {wire.TOKEN_BYTES} bytes, got {len(token)}")
        self.where = f"{host}:{port}"
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            self._sock.sendall(token)
            ack = wire.recv_by(self._sock, wire.TOKEN_BYTES,
                               time.monotonic() + HANDSHAKE_TIMEOUT) if verify else None
            self._sock.settimeout(SEND_TIMEOUT)  # a peer that stops reading fails the send
        except (OSError, EOFError) as e:
            self.close()
            raise RemoteError(f"cannot reach the inbox at {self.where}: {e}") from e
        if ack is not None and not hmac.compare_digest(ack, wire.token_ack(token)):
            self.close()
            raise RemoteError(f"what answers at {self.where} is not the session's inbox (it "
                              f"did not acknowledge the token)")
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
            if hasattr(self, "_sock"):
                self._sock.close()
        except OSError:
            pass

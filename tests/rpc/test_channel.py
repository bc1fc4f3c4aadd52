"""The inbox a pipeline's boards pass tensors through: framed tensors by input and name, a
token before anything, every frame checked, a stopped stream that wakes its reader."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from hgrt.errors import InputError, RemoteError
from hgrt.rpc.channel import Inbox, Outbox
from hgrt.rpc.wire import FRAME


def test_tensors_arrive_by_input_and_name_and_are_taken_once():
    inbox = Inbox()
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    a = np.arange(12, dtype="float32").reshape(3, 4)
    b = np.array([1, 2], "int64")
    box.send(7, "b", b)
    threading.Timer(0.2, box.send, (7, "a", a)).start()  # the reader waits for it
    got = inbox.take(7, ["a", "b"], timeout=10)
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)
    assert got["a"].dtype == np.float32 and inbox.pending() == 0
    with pytest.raises(RemoteError, match=r"input 7: \['a'\] did not come within 0.2 s"):
        inbox.take(7, ["a"], timeout=0.2)
    box.close()
    inbox.close()


def test_a_sender_without_the_token_is_dropped():
    inbox = Inbox()
    with pytest.raises(InputError, match="16 bytes"):
        Outbox("127.0.0.1", inbox.port, b"short")
    wrong = Outbox("127.0.0.1", inbox.port, bytes(16))
    try:
        wrong.send(0, "x", np.ones(3, "float32"))
    except RemoteError:
        pass  # the inbox may have closed the connection already
    with pytest.raises(RemoteError, match="did not come"):
        inbox.take(0, ["x"], timeout=0.5)
    inbox.close()


def _closed_by_peer(conn: socket.socket) -> bool:
    """Whether the other end closed ``conn`` (a reset: it closed with our bytes unread)."""
    try:
        while conn.recv(4096):  # the inbox's acknowledgement of the token, then the end
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _frame(header: bytes, payload: int, declared: int | None = None) -> bytes:
    return FRAME.pack(0, len(header) if declared is None else declared, payload) + header


@pytest.mark.parametrize("frame, why", [
    (_frame(b"", 0, declared=10_000), "frame header of 10000 bytes"),
    (_frame(b"nope", 0), "not {name, dtype, shape} JSON"),
    (_frame(b'{"name": "x", "dtype": "object", "shape": [1]}', 4), "dtype 'object'"),
    (_frame(b'{"name": "x", "dtype": "float32", "shape": [1]}', 8), "8 payload bytes"),
], ids=["long header", "not JSON", "object dtype", "wrong size"])
def test_a_bad_frame_closes_its_own_connection_and_says_why(frame, why):
    """A bad frame on one connection: that connection is closed and the inbox records why;
    a stage waiting for another sender's tensor still gets it."""
    inbox = Inbox()
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    box.send(1, "y", np.ones(2, "float32"))
    inbox.take(1, ["y"], timeout=10)  # the good sender is connected and read
    raw = socket.create_connection(("127.0.0.1", inbox.port))
    raw.settimeout(10)
    raw.sendall(inbox.token + frame)
    assert _closed_by_peer(raw)  # the inbox closed it
    assert why in inbox.refused[-1]
    threading.Timer(0.2, box.send, (2, "z", np.full(2, 3.0, "float32"))).start()
    np.testing.assert_array_equal(inbox.take(2, ["z"], timeout=10)["z"], 3.0)
    box.close()
    raw.close()
    inbox.close()


def test_an_abort_wakes_the_waiting_reader():
    inbox = Inbox()
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    threading.Timer(0.2, box.abort, ("stage 0 on board a is lost",)).start()
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="stopped before.*stage 0 on board a is lost"):
        inbox.take(3, ["x"], timeout=30)
    assert time.monotonic() - t0 < 5
    box.close()
    inbox.close()


def test_an_abort_stops_one_stream_and_drops_what_it_sent_not_another():
    """Two pipelines on one board: the abort of one fails its waiting stage and drops its
    tensors; the other's tensors stay and its stage goes on."""
    inbox = Inbox()
    for stream in "ab":
        inbox.announce(stream, {"x": ("float32", (2,))}, window=4)
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    box.send(1, "x", np.ones(2, "float32"), stream="a")
    box.send(1, "x", np.full(2, 2.0, "float32"), stream="b")
    box.abort("stage 0 of pipeline a is lost", stream="a")
    with pytest.raises(RemoteError, match="pipeline a is lost"):
        inbox.take(2, ["x"], timeout=5, stream="a")
    np.testing.assert_array_equal(inbox.take(1, ["x"], timeout=5, stream="b")["x"], 2.0)
    assert inbox.pending() == 0  # stream a's tensor was dropped with its abort
    box.close()
    inbox.close()


def test_a_peer_the_server_does_not_allow_is_closed_at_once(monkeypatch):
    from hgrt.rpc import channel

    monkeypatch.setattr(channel, "SESSION_ALLOWED", lambda host: False)
    inbox = Inbox()
    raw = socket.create_connection(("127.0.0.1", inbox.port))
    raw.settimeout(5)
    assert raw.recv(1) == b""  # closed before a byte is read
    raw.close()
    inbox.close()


def _refused(inbox: Inbox, frames: bytes) -> str:
    """Send ``frames`` on a connection of its own: the reason the inbox closed it."""
    raw = socket.create_connection(("127.0.0.1", inbox.port))
    raw.settimeout(10)
    raw.sendall(inbox.token + frames)
    assert _closed_by_peer(raw)
    raw.close()
    return inbox.refused[-1]


def _tensor(seq: int, name: str, value: np.ndarray, stream: str = "s") -> bytes:
    from hgrt.rpc import wire

    return wire.frame_head(seq, name, value, stream) + value.tobytes()


def test_an_inbox_admits_only_what_a_stage_announced(monkeypatch):
    """Announced: tensor x of stream s, float32[4], from input 0, two inputs ahead. Another
    name, dtype, shape, or an input past the window closes its connection (the reason kept);
    what was announced comes through on another connection meanwhile."""
    from hgrt.rpc import channel

    monkeypatch.setattr(channel, "ANNOUNCE_TIMEOUT", 0.3)
    inbox = Inbox()
    inbox.announce("s", {"x": ("float32", (4,))}, window=2)
    x = np.ones(4, "float32")
    assert "no stage announced it" in _refused(inbox, _tensor(0, "y", x))
    assert "no stage announced it" in _refused(inbox, _tensor(0, "x", x, stream="other"))
    assert "announced float32[4]" in _refused(inbox, _tensor(0, "x", x.astype("float64")))
    assert "announced float32[4]" in _refused(inbox, _tensor(0, "x", np.ones(5, "float32")))
    assert "beyond the announced window (inputs 0 to 1)" in _refused(inbox, _tensor(2, "x", x))
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    for i in range(6):  # taken as they come: the window moves with the takes
        box.send(i, "x", x * i, "s")
        np.testing.assert_array_equal(inbox.take(i, ["x"], timeout=5, stream="s")["x"], x * i)
    assert inbox.held_bytes() == 0 and inbox.pending() == 0
    with pytest.raises(InputError, match="announced as float32\\[4\\], now int8\\[4\\]"):
        inbox.announce("s", {"x": ("int8", (4,))}, window=2)
    with pytest.raises(InputError, match="a window of 0 inputs"):
        inbox.announce("t", {"x": None}, window=0)
    box.close()
    inbox.close()


def test_a_frame_sent_before_its_announcement_waits_for_it():
    inbox = Inbox()
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    box.send(0, "x", np.full(3, 7.0, "float32"), "late")
    deadline = time.monotonic() + 5
    while inbox.pending() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inbox.pending() == 1 and inbox.held_bytes() == 0  # at the door, nothing allocated
    inbox.announce("late", {"x": ("float32", (3,))}, window=1)
    np.testing.assert_array_equal(inbox.take(0, ["x"], timeout=5, stream="late")["x"], 7.0)
    box.close()
    inbox.close()


def test_a_verifying_sender_tells_the_inbox_from_another_service(monkeypatch):
    """An inbox acknowledges the token; a sender that asks for it is refused by a listener that
    is not an inbox (silent, or answering something else), within the handshake's time."""
    from hgrt.rpc import channel

    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT", 0.5)
    inbox = Inbox()
    Outbox("127.0.0.1", inbox.port, inbox.token, verify=True).close()
    other = socket.create_server(("127.0.0.1", 0))
    port = other.getsockname()[1]
    answer = threading.Thread(target=lambda: [other.accept()[0].sendall(b"SSH-2.0-x" * 2),
                                              other.accept()], daemon=True)
    answer.start()
    with pytest.raises(RemoteError, match="not the session's inbox"):
        Outbox("127.0.0.1", port, inbox.token, verify=True)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="cannot reach the inbox"):
        Outbox("127.0.0.1", port, inbox.token, verify=True)  # accepted, never answered
    assert time.monotonic() - t0 < 5
    other.close()
    inbox.close()

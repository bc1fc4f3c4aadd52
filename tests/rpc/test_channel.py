"""The inbox a pipeline's boards pass tensors through: framed tensors by input and name, a
token before anything, every frame checked, a stopped stream that wakes its reader."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from hgrt.errors import InputError, RemoteError
from hgrt.rpc.channel import FRAME, Inbox, Outbox


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
    wrong.send(0, "x", np.ones(3, "float32"))
    with pytest.raises(RemoteError, match="did not come"):
        inbox.take(0, ["x"], timeout=0.5)
    inbox.close()


def _frame(header: bytes, payload: int, declared: int | None = None) -> bytes:
    return FRAME.pack(0, len(header) if declared is None else declared, payload) + header


@pytest.mark.parametrize("frame, why", [
    (_frame(b"", 0, declared=10_000), "frame header of 10000 bytes"),
    (_frame(b"nope", 0), "not {name, dtype, shape} JSON"),
    (_frame(b'{"name": "x", "dtype": "object", "shape": [1]}', 4), "dtype 'object'"),
    (_frame(b'{"name": "x", "dtype": "float32", "shape": [1]}', 8), "8 payload bytes"),
], ids=["long header", "not JSON", "object dtype", "wrong size"])
def test_a_bad_frame_ends_the_stream_with_why(frame, why):
    inbox = Inbox()
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    box.send(1, "y", np.ones(2, "float32"))
    raw = socket.create_connection(("127.0.0.1", inbox.port))
    raw.sendall(inbox.token + frame)
    time.sleep(0.3)
    box.close()  # the good sender leaves too: nothing more can come
    with pytest.raises(RemoteError, match=why.replace("{", r"\{").replace("}", r"\}")):
        inbox.take(1, ["y", "z"], timeout=5)
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

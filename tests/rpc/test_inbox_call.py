"""A remote module's calls through its session's inbox (``hgrt.rpc.inbox_call``), with a real
tracker and real ``hgrt rpc-server`` processes on 127.0.0.1: outputs bitwise equal to the
TVM RPC path, the fallback where the inbox is not reached, calls from several threads, and a
closed module."""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest
import tvm

import hgrt
import hgrt.rpc
from hgrt.rpc.client import RemoteGraphModule
from hgrt.rpc.wire import InboxAddress
from hgrt.testing import conv_model

pytestmark = pytest.mark.rpc

REQUEST_TIMEOUT = 20.0
THREADS, CALLS = 4, 12  # concurrent callers, calls each
CALL_LIMIT = 10.0  # seconds any one call may take here


@pytest.fixture(scope="module")
def conv_art(tmp_path_factory):
    result = hgrt.build(conv_model(), ["cpu:0", "cpu:1"],
                        hgrt.Placement(rules={"nn.conv2d": "cpu:1"}, preferred="cpu:0"))
    return hgrt.save(str(tmp_path_factory.mktemp("inbox_call") / "conv"), result)


@pytest.fixture
def remote(rpc_env):
    sess = hgrt.rpc.connect(tracker=rpc_env.tracker, key=rpc_env.key, timeout=REQUEST_TIMEOUT)
    yield sess
    del sess


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype("float32")


def _timed_call(m, x):
    t0 = time.monotonic()
    out = m(x=x)
    assert time.monotonic() - t0 < CALL_LIMIT
    return out


def test_a_call_through_the_inbox_equals_the_rpc_path_bitwise(remote, conv_art, caplog):
    with hgrt.load(conv_art, ["cpu:0", "cpu:1"], session=remote) as m, \
            caplog.at_level(logging.INFO, logger="hgrt.rpc"):
        m.configure_transfer("rpc")
        assert m.transfer == "rpc"
        want = [m(x=_x(s))[0] for s in range(3)]
        m.configure_transfer("inbox")  # fails rather than falls back
        for s in (0, 1, 2, 1):
            np.testing.assert_array_equal(_timed_call(m, _x(s))[0], want[s])
        assert m.transfer == "inbox"
        out = [np.empty_like(want[2])]
        assert m(x=_x(2), out=out) is out
        np.testing.assert_array_equal(out[0], want[2])
        m.configure_transfer("auto")
        np.testing.assert_array_equal(m(x=tvm.runtime.tensor(_x(0)))[0], want[0])
        m.set_input("x", _x(1))  # a call leaves what set_input set untouched
        m.run()
        np.testing.assert_array_equal(m.get_output(0).numpy(), want[1])
        assert m.transfer == "inbox"
    assert "calls go through TVM RPC" not in caplog.text


class _Closed:
    """A port nothing listens on."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    def close(self):
        pass


class _Other:
    """Another service: it accepts, reads, and answers 16 bytes that are not the inbox's."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        for _ in range(8):  # bounded: a test connects once or twice
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    conn.recv(64)
                    conn.sendall(b"HTTP/1.0 400 Bad")
                except OSError:
                    pass

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("service", [_Closed, _Other], ids=["closed-port", "another-service"])
def test_an_inbox_that_cannot_be_reached_falls_back_once_and_answers_right(
        remote, conv_art, monkeypatch, caplog, service):
    """As over an SSH tunnel whose inbox port is not forwarded: the address the client would
    reach the inbox at is a closed port, or some other service."""
    there = service()
    real = RemoteGraphModule.inbox
    monkeypatch.setattr(RemoteGraphModule, "inbox", lambda self: InboxAddress(
        "127.0.0.1", there.port, real(self).token))
    try:
        with hgrt.load(conv_art, ["cpu:0", "cpu:1"], session=remote) as m:
            m.configure_transfer("rpc")
            want = [m(x=_x(s))[0] for s in range(3)]
            m.configure_transfer("inbox")
            with pytest.raises(hgrt.RemoteError, match="a call through the inbox failed"):
                m(x=_x(0))
            m.configure_transfer("auto")
            with caplog.at_level(logging.INFO, logger="hgrt.rpc"):
                for s in (0, 1, 2, 0):
                    np.testing.assert_array_equal(_timed_call(m, _x(s))[0], want[s])
            assert m.transfer == "rpc"
    finally:
        there.close()
    lines = [r for r in caplog.records if "calls go through TVM RPC" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "inbox" in lines[0].getMessage()


def test_a_server_without_an_inbox_falls_back(remote, conv_art, monkeypatch, caplog):
    """An older server: no inbox function (the client's call of it fails as for one)."""

    def no_inbox(self):
        raise hgrt.RemoteError("the server has no 'hgrt.remote.inbox' (an older server?)")

    monkeypatch.setattr(RemoteGraphModule, "inbox", no_inbox)
    with hgrt.load(conv_art, ["cpu:0", "cpu:1"], session=remote) as m, \
            caplog.at_level(logging.INFO, logger="hgrt.rpc"):
        assert m.transfer == "inbox"  # not yet tried
        y0, y1 = m(x=_x(0))[0], m(x=_x(1))[0]
        assert m.transfer == "rpc"
        assert not np.array_equal(y0, y1)
        m.configure_transfer("rpc")
        np.testing.assert_array_equal(m(x=_x(0))[0], y0)
    assert caplog.text.count("older server") == 1


def test_a_lost_inbox_connection_falls_back_mid_stream(remote, conv_art, caplog):
    """The connection to the inbox breaks between two calls: the call goes through RPC."""
    with hgrt.load(conv_art, ["cpu:0", "cpu:1"], session=remote) as m, \
            caplog.at_level(logging.INFO, logger="hgrt.rpc"):
        m.configure_transfer("rpc")
        want = m(x=_x(5))[0]
        m.configure_transfer("auto")
        np.testing.assert_array_equal(m(x=_x(5))[0], want)
        assert m.transfer == "inbox"
        m._transfer._call.outbox._sock.close()  # the socket is gone under the stream
        np.testing.assert_array_equal(_timed_call(m, _x(5))[0], want)
        assert m.transfer == "rpc"
    assert caplog.text.count("calls go through TVM RPC") == 1


def test_concurrent_calls_from_several_threads_stay_right(remote, conv_art):
    with hgrt.load(conv_art, ["cpu:0", "cpu:1"], session=remote) as m, \
            hgrt.load(conv_art, ["cpu:0", "cpu:1"], session=remote) as other:
        m.configure_transfer("rpc")
        xs = [_x(100 + i) for i in range(THREADS * CALLS)]
        want = [m(x=x)[0] for x in xs]
        m.configure_transfer("inbox")
        other.configure_transfer("inbox")  # a second module: a second stream in one inbox
        wrong, errors = [], []

        def caller(t):
            try:
                for i in range(t, len(xs), THREADS):
                    mod = m if i % 3 else other
                    y = _timed_call(mod, xs[i])[0]
                    if not np.array_equal(y, want[i]):
                        wrong.append(i)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert not wrong
        assert m.transfer == other.transfer == "inbox"


def test_a_closed_module_refuses_calls(remote, conv_art):
    m = hgrt.load(conv_art, ["cpu:0", "cpu:1"], session=remote)
    y = m(x=_x(7))[0]
    assert m.transfer == "inbox"
    box = m._transfer._call
    m.close()
    assert m._transfer._call is None and box.outbox._sock.fileno() == -1  # its socket closed
    with pytest.raises(hgrt.ClosedError):
        m(x=_x(7))
    with pytest.raises(hgrt.ClosedError):
        m.infer({"x": _x(7)})
    with hgrt.load(conv_art, ["cpu:0", "cpu:1"], session=remote) as again:  # the board serves on
        np.testing.assert_array_equal(again(x=_x(7))[0], y)

"""A pipeline over ``tvm.rpc.LocalSession``s: board-to-board transfer through the sessions'
inbox in this process, with the choices ``transfer="auto"`` makes and the races of close()."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tvm

import hgrt
from hgrt.pipelines import load_pipeline
from hgrt.rpc.client import RemoteGraphModule
from hgrt.testing import conv_model, reference


@pytest.fixture(scope="module")
def conv_pipeline(tmp_path_factory):
    from hgrt.stages import split

    out = tmp_path_factory.mktemp("local") / "conv"
    split(conv_model(), 2, kernels="tvm").save(out)
    return out


def _x(seed: int = 0) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype("float32")}


def test_two_stages_on_one_session_are_refused_direct_and_go_through_the_client_on_auto(
        conv_pipeline, caplog):
    session = tvm.rpc.LocalSession()
    with pytest.raises(hgrt.InputError, match="stages 0 and 1 are on one RPC session"):
        load_pipeline(conv_pipeline, [session, session], transfer="direct")
    with caplog.at_level("WARNING", logger="hgrt.pipeline"):
        with load_pipeline(conv_pipeline, [session, session]) as p:
            assert p.transfer == "client"
            x = _x()
            np.testing.assert_allclose(p(x)[0], reference(conv_model(), x)[0], rtol=1e-5,
                                       atol=1e-5)
    assert "stages 0 and 1 are on one RPC session" in caplog.text


def test_auto_falls_back_on_any_failure_of_a_link(conv_pipeline, monkeypatch, caplog):
    """A board that cannot link to the next one fails with TVM's own error: 'auto' still goes
    through the client, 'direct' says why."""

    def no_route(self, to):
        raise tvm.error.RPCError(f"connect to {to}: no route to host")

    monkeypatch.setattr(RemoteGraphModule, "link", no_route)
    sessions = [tvm.rpc.LocalSession(), tvm.rpc.LocalSession()]
    with pytest.raises(tvm.error.RPCError, match="no route to host"):
        load_pipeline(conv_pipeline, sessions, transfer="direct")
    with caplog.at_level("WARNING", logger="hgrt.pipeline"):
        with load_pipeline(conv_pipeline, sessions) as p:
            assert p.transfer == "client"
            x = _x(1)
            np.testing.assert_allclose(p(x)[0], reference(conv_model(), x)[0], rtol=1e-5,
                                       atol=1e-5)
    assert "no route to host" in caplog.text


def test_submits_racing_close_board_to_board_are_refused_or_answered(conv_pipeline):
    """Inputs sent to the boards' inboxes while close() runs: each submit is refused with a
    ClosedError or answered, never an IndexError or a Future left waiting."""
    x = _x(2)
    want = None
    for round_ in range(3):
        p = load_pipeline(conv_pipeline, [tvm.rpc.LocalSession(), tvm.rpc.LocalSession()],
                          transfer="direct")
        want = p(x)[0] if want is None else want
        futures, errors, go = [], [], threading.Event()

        def feed(p=p, futures=futures, errors=errors, go=go, at=5 + 10 * round_):
            for i in range(60):
                if i == at:
                    go.set()
                try:
                    futures.append(p.submit(x))
                except hgrt.HgrtError as err:
                    errors.append(err)

        t = threading.Thread(target=feed)
        t.start()
        go.wait(30)
        p.close()
        t.join(30)
        assert all(isinstance(e, hgrt.ClosedError) for e in errors), errors[:1]
        for f in futures:
            assert f.done()
            if f.exception() is None:
                np.testing.assert_array_equal(f.result()[0], want)
            else:
                assert isinstance(f.exception(), hgrt.HgrtError), f.exception()


def test_the_boards_inboxes_admit_only_what_the_stages_announced(conv_pipeline):
    """A direct pipeline announces each stage's tensors: a frame of the pipeline's own stream
    with another shape, or far past the window, closes its own connection (the inbox says why)
    and the pipeline's outputs stay right; a stage whose module input disagrees is refused."""
    import socket

    from hgrt.rpc import server, wire

    x = _x(3)
    want = reference(conv_model(), x)[0]
    with load_pipeline(conv_pipeline, [tvm.rpc.LocalSession(), tvm.rpc.LocalSession()],
                       transfer="direct") as p:
        inbox = server._inbox()  # the LocalSessions' inbox, in this process
        stream = p.links.stream
        for seq, value in ((0, np.ones((1, 3, 8, 9), "float32")),
                           (10_000, np.ones((1, 3, 8, 8), "float32"))):
            raw = socket.create_connection(("127.0.0.1", inbox.port))
            raw.settimeout(10)
            raw.sendall(inbox.token + wire.frame_head(seq, "x", value, stream) + value.tobytes())
            try:
                while raw.recv(4096):  # the token's acknowledgement, then closed by the inbox
                    pass
            except ConnectionResetError:
                pass  # closed with our payload unread
            raw.close()
        assert "announced float32[1, 3, 8, 8]" in inbox.refused[-2]
        assert "beyond the announced window" in inbox.refused[-1]
        for y in p.map([x] * 5):
            np.testing.assert_allclose(y[0], want, rtol=1e-5, atol=1e-5)
        spec = wire.announcement(p.links.specs[0], {"x": ("float32", (1, 3, 8, 9))}, 4, 0)
        with pytest.raises(hgrt.InputError, match="the module's input is float32"):
            p.modules[0].announce(spec)


def test_an_inbox_address_that_is_another_service_falls_back_to_the_client(
        conv_pipeline, monkeypatch, caplog):
    """Over an SSH tunnel a board's inbox address is its own loopback, here this machine's:
    a silent local listener there is not taken for the inbox; 'auto' goes through the client."""
    import socket

    from hgrt.rpc import channel
    from hgrt.rpc.wire import InboxAddress

    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT", 0.5)
    unrelated = socket.create_server(("127.0.0.1", 0))
    real = RemoteGraphModule.inbox
    monkeypatch.setattr(RemoteGraphModule, "inbox", lambda self: InboxAddress(
        "127.0.0.1", unrelated.getsockname()[1], real(self).token))
    sessions = [tvm.rpc.LocalSession(), tvm.rpc.LocalSession()]
    with caplog.at_level("WARNING", logger="hgrt.pipeline"):
        with load_pipeline(conv_pipeline, sessions) as p:
            assert p.transfer == "client"
            x = _x(4)
            np.testing.assert_allclose(p(x)[0], reference(conv_model(), x)[0], rtol=1e-5,
                                       atol=1e-5)
    assert "not the session's inbox" in caplog.text or "cannot reach the inbox" in caplog.text
    unrelated.close()

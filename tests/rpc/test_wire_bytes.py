"""The bytes that cross between a client and its boards, pinned: an inbox frame, a stage spec and
a stage reply. A change here changes what a server of another hgrt version reads; it must be on
purpose, never a side effect of moving code."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest
import tvm

import hgrt
from hgrt.errors import InputError, RemoteError
from hgrt.rpc import server
from hgrt.rpc.channel import Inbox, Outbox
from hgrt.testing import GraphBuilder, N, conv_model, elementwise_lib

TOKEN = bytes(range(16))
# Outbox.send(7, "a", [0, 1, 2] float32, stream="s1"): the token once per connection, then per
# frame <q I Q (sequence number, header length, payload bytes), the JSON header, the payload.
FRAME_BYTES = bytes.fromhex(
    "000102030405060708090a0b0c0d0e0f"
    "0700000000000000" "3f000000" "0c00000000000000"
) + b'{"name": "a", "dtype": "float32", "shape": [3], "stream": "s1"}' + bytes.fromhex(
    "00000000" "0000803f" "00000040")
# Outbox.abort("lost", stream="s1"): a frame of sequence -1 named __abort__, the reason as bytes.
ABORT_BYTES = bytes.fromhex("ffffffffffffffff" "45000000" "0400000000000000") + \
    b'{"name": "__abort__", "dtype": "uint8", "shape": [4], "stream": "s1"}lost'
# The stage specs a two-stage pipeline of conv_model sends its boards (stream fixed here; the
# board's link id is filled in from what the board handed out).
STREAM = "00112233aabbccdd"
SPEC_0 = (b'{"take": ["x"], "outputs": ["lv4"], "stream": "00112233aabbccdd", "inputs": {"x": 0}, '
          b'"send": ["lv4"], "outbox": %d, "return": []}')
SPEC_1 = (b'{"take": ["lv4"], "outputs": ["gv"], "stream": "00112233aabbccdd", '
          b'"inputs": {"lv4": 0}, "send": [], "outbox": -1, "return": ["gv"]}')
# A stage reply: the server's seconds as little-endian float64, then the returned tensors' bytes.
REPLY_SECONDS = bytes.fromhex("000000000000d03f")  # 0.25


def _read_all(conn: socket.socket) -> bytes:
    conn.settimeout(10)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_an_outbox_writes_these_bytes():
    listener = socket.create_server(("127.0.0.1", 0))
    box = Outbox("127.0.0.1", listener.getsockname()[1], TOKEN)
    conn, _ = listener.accept()
    box.send(7, "a", np.arange(3, dtype="float32"), stream="s1")
    box.abort("lost", stream="s1")
    box.close()
    assert _read_all(conn) == FRAME_BYTES + ABORT_BYTES
    conn.close()
    listener.close()


def test_an_inbox_reads_these_bytes():
    inbox = Inbox()
    raw = socket.create_connection(("127.0.0.1", inbox.port))
    raw.sendall(inbox.token + FRAME_BYTES[len(TOKEN):])
    got = inbox.take(7, ["a"], timeout=10, stream="s1")["a"]
    assert got.dtype == np.float32 and got.tolist() == [0.0, 1.0, 2.0]
    raw.sendall(ABORT_BYTES)
    with pytest.raises(RemoteError, match="stopped before.*lost"):
        inbox.take(8, ["a"], timeout=10, stream="s1")
    raw.close()
    inbox.close()


@pytest.fixture(scope="module")
def conv_pipeline(tmp_path_factory):
    from hgrt.stages import split

    out = tmp_path_factory.mktemp("wire") / "conv"
    res = split(conv_model(), 2, kernels="tvm")
    assert [[t.name for t in p.outputs] for p in res.plans] == [["lv4"], ["gv"]]
    res.save(out)
    return out


def test_a_pipeline_sends_its_boards_these_stage_specs(conv_pipeline, monkeypatch):
    import secrets

    from hgrt.pipelines import load_pipeline

    seen = []
    run_stage = server.RemoteModuleServer.run_stage

    def recording(self, seq, spec_json):
        reply = run_stage(self, seq, spec_json)
        seen.append((str(spec_json).encode(), bytes(reply)))
        return reply

    monkeypatch.setattr(server.RemoteModuleServer, "run_stage", recording)
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: STREAM)
    x = {"x": (np.arange(192, dtype="float32") / 100).reshape(1, 3, 8, 8)}
    sessions = [tvm.rpc.LocalSession(), tvm.rpc.LocalSession()]
    with load_pipeline(conv_pipeline, sessions, transfer="direct") as p:
        y = p(x)[0]
        ms = p.stage_ms()
    # the last stage may return, and be recorded, before the first one's wrapper records it
    (spec0, reply0), (spec1, reply1) = sorted(seen, key=lambda s: json.loads(s[0])["outbox"] < 0)
    link = json.loads(spec0)["outbox"]
    assert isinstance(link, int) and link > 0
    assert spec0 == SPEC_0 % link
    assert spec1 == SPEC_1
    assert len(reply0) == 8 and reply1[8:] == y.astype("<f4").tobytes()
    assert ms[1] == pytest.approx(1e3 * np.frombuffer(reply1[:8], "<f8")[0])


def _one_op_graph() -> str:
    g = GraphBuilder()
    g.output(g.op("add_one", [g.input("x")]))
    return g.json()


def test_a_server_replies_to_a_stage_with_these_bytes():
    module = server.RemoteModuleServer(hgrt.create(_one_op_graph(), elementwise_lib(),
                                                   [tvm.cpu(0)]))
    where = json.loads(server.remote_inbox())
    assert list(where) == ["address", "port", "token"]
    box = Outbox(where["address"], where["port"], bytes.fromhex(where["token"]))
    box.send(11, "x", np.arange(N, dtype="float32"), stream="wire")
    deadline = time.monotonic() + 10
    while server._inbox().pending() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the session's inbox has read the frame
    spec = ('{"take": ["x"], "outputs": ["y"], "stream": "wire", "inputs": {"x": 0}, '
            '"send": [], "outbox": -1, "return": ["y"]}')
    reply = bytes(module.run_stage(11, spec))
    box.close()
    assert reply[8:] == np.arange(1, N + 1, dtype="<f4").tobytes()
    assert 0 <= np.frombuffer(reply[:8], "<f8")[0] < 5
    with pytest.raises(InputError, match="a bad stage description"):
        module.run_stage(12, '{"take": ["x"], "outputs": ["y"], "send": [], "return": []}')


def test_a_client_reads_a_stage_reply_of_these_bytes(monkeypatch):
    session = tvm.rpc.LocalSession()
    m = hgrt.create(_one_op_graph(), elementwise_lib(), [session.cpu(0)])
    payload = np.arange(N, dtype="<f4").tobytes()
    monkeypatch.setattr(server.RemoteModuleServer, "run_stage",
                        lambda self, seq, spec: REPLY_SECONDS + payload)
    t0 = time.monotonic()
    seconds, data = m.run_stage(3, {"take": ["x"]})
    assert (seconds, bytes(data)) == (0.25, payload)
    assert time.monotonic() - t0 < 10
    m.close()

"""`hgrt rpc-server --allow ADDR|CIDR`: a client from another address is disconnected before
the handshake (and the log names it); an allowed one gets a full hgrt session, standalone and
through a tracker; each session's end is logged with the hgrt modules it left alive.

The allowed client is 127.0.0.2: a relay process (source_relay.py) connects from there.
"""

from __future__ import annotations

import gc
import os
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest
import tvm
from conftest import Proc, _spawn, _wait, free_port
from tvm.rpc import base as rpc_base

import hgrt
import hgrt.rpc
from hgrt.errors import InputError, RemoteError
from hgrt.rpc.listen import is_allowed, parse_allow
from hgrt.rpc.protocol import parse_address
from hgrt.rpc.session import _request_server
from hgrt.testing import GraphBuilder, N

ALLOWED = "127.0.0.2"
RELAY = os.path.join(os.path.dirname(__file__), "source_relay.py")


def test_allow_takes_addresses_and_blocks():
    nets = parse_allow(["127.0.0.2", "10.0.0.0/24", "::1"])
    assert is_allowed("127.0.0.2", nets) and is_allowed("10.0.0.77", nets)
    assert is_allowed("::ffff:127.0.0.2", nets)  # an IPv4 peer of a dual-stack socket
    assert is_allowed("::1", nets)
    assert not is_allowed("127.0.0.1", nets) and not is_allowed("10.0.1.1", nets)
    assert is_allowed("192.0.2.1", parse_allow([]))  # no --allow: everyone
    for bad in ("localhost", "10.0.0.0/33", ""):
        with pytest.raises(InputError, match="--allow takes an IP address or a CIDR block"):
            parse_allow([bad])


def test_bad_allow_is_refused_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "hgrt", "rpc-server", "--allow", "board"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--allow" in proc.stderr, proc.stderr


def start_server(tmp_path, *args: str) -> tuple[Proc, int]:
    port = free_port()
    proc = _spawn([sys.executable, "-m", "hgrt", "rpc-server", "--port", str(port), "--port-end",
                   str(port + 1), "--allow", ALLOWED, *args], str(tmp_path / "server.log"))
    _wait(lambda: "rpc-server listening on" in proc.output(), "hgrt rpc-server", proc)
    return proc, port


def start_relay(tmp_path, upstream: str) -> tuple[Proc, int]:
    port = free_port()
    proc = _spawn([sys.executable, RELAY, str(port), upstream, ALLOWED],
                  str(tmp_path / f"relay-{port}.log"))
    _wait(lambda: "relay ready" in proc.output(), "source relay", proc)
    return proc, port


def two_device_module(remote, lib_path: str):
    g = GraphBuilder()
    x = g.input("x", dev=0)
    g.output(g.op("add_one", [g.copy(g.op("add_one", [x], dev=0), dev=1)], dev=1))
    m = hgrt.create(g.json(pools=True), hgrt.rpc.upload(remote, lib_path),
                    [remote.cpu(0), remote.cpu(1)])
    x = np.arange(N, dtype="float32")
    m.run(x=x)
    np.testing.assert_array_equal(m.get_output(0).numpy(), x + 2)
    return m


def raw_handshake(port: int, key: bytes, source: str, magic: int = rpc_base.RPC_MAGIC,
                  size: int | None = None) -> bytes:
    """What the server answers a hand-made handshake from ``source`` (b"": nothing)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(source, 0)) as s:
        try:
            s.sendall(struct.pack("<ii", magic, len(key) if size is None else size) + key)
            return s.recv(64)
        except ConnectionResetError:
            return b""


def check_handshakes(port: int) -> None:
    # another address: closed before any byte
    assert raw_handshake(port, b"client:k", "127.0.0.1") == b""
    # an allowed address: TVM's answers, and junk does not stop the server
    ok = raw_handshake(port, b"client:k", ALLOWED)
    assert ok[:4] == struct.pack("<i", rpc_base.RPC_CODE_SUCCESS) and ok.endswith(b"server:k")
    assert raw_handshake(port, b"client:x", ALLOWED) == \
        struct.pack("<i", rpc_base.RPC_CODE_MISMATCH)
    assert raw_handshake(port, b"client:k", ALLOWED, magic=1234) == b""
    assert raw_handshake(port, b"client:k", ALLOWED, size=1 << 30) == b""
    assert raw_handshake(port, b"client:k -timeout=soon", ALLOWED) == b""


@pytest.mark.rpc
def test_standalone_refuses_other_addresses_and_serves_allowed_ones(tmp_path, lib_path):
    server, port = start_server(tmp_path, "--key", "k")
    relay = None
    try:
        assert "clients from 127.0.0.2 only" in server.output()
        check_handshakes(port)
        with pytest.raises(RemoteError, match=rf"cannot open an RPC session with server "
                                              rf"127.0.0.1:{port} \(key 'k'\)"):
            hgrt.rpc.connect(server=f"127.0.0.1:{port}", key="k")
        _wait(lambda: server.output().count("refused a connection from 127.0.0.1:") == 2,
              "two refusals in the server log", server, timeout=10)

        relay, relay_port = start_relay(tmp_path, f"127.0.0.1:{port}")
        remote = hgrt.rpc.connect(server=f"127.0.0.1:{relay_port}", key="k")
        m = two_device_module(remote, lib_path)
        left = sum(m.device_bytes)
        assert hgrt.rpc.stats(remote)["modules"] == 1
        relay.kill()  # the connection drops with the module alive: the server says so
        _wait(lambda: f"ended: 1 hgrt module(s) still alive ({left} bytes)" in server.output(),
              "the session's last line", server, timeout=30)
        assert f"session from {ALLOWED}:" in server.output()
        del m, remote
        gc.collect()
    finally:
        for proc in (relay, server):
            if proc is not None:
                proc.kill()


@pytest.mark.rpc
def test_tracker_hands_out_a_server_that_only_allowed_clients_reach(rpc_env, tmp_path,
                                                                     lib_path):
    key = "hgrt-allow"
    server, _ = start_server(tmp_path, "--tracker", rpc_env.tracker, "--key", key)
    relay = None
    try:
        rpc_env.wait_free(key, server)
        with pytest.raises(RemoteError, match=rf"tracker {rpc_env.tracker} gave server "
                                              rf"127.0.0.1:\d+ for key '{key}', but the session "
                                              rf"could not be opened"):
            hgrt.rpc.connect(tracker=rpc_env.tracker, key=key, timeout=20)
        _wait(lambda: "refused a connection from 127.0.0.1:" in server.output(),
              "the refusal in the server log", server, timeout=10)

        rpc_env.wait_free(key, server, timeout=30)  # the unused match key is replaced
        host, port, matchkey = _request_server(parse_address(rpc_env.tracker), key, 20, 1)
        relay, relay_port = start_relay(tmp_path, f"{host}:{port}")
        remote = tvm.rpc.connect("127.0.0.1", relay_port, matchkey)
        m = two_device_module(remote, lib_path)
        del m
        gc.collect()
        assert hgrt.rpc.stats(remote)["modules"] == 0
        del remote
        gc.collect()  # the session ends: the server logs it and registers again
        _wait(lambda: "ended: 0 hgrt module(s) still alive (0 bytes)" in server.output(),
              "the session's last line", server, timeout=30)
        rpc_env.wait_free(key, server, timeout=30)
    finally:
        for proc in (relay, server):
            if proc is not None:
                proc.kill()

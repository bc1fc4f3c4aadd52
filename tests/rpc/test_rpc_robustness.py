"""Faults of remote execution, through a real tracker and real hgrt rpc-server processes on
127.0.0.1: each test fails on the code before its fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import hgrt
import hgrt.rpc
from hgrt.errors import InputError, ParamError
from hgrt.rpc.server import serve
from hgrt.testing import GraphBuilder, N, add_one_chain, elementwise_lib

sys.path.insert(0, os.path.dirname(__file__))
from test_rpc_remote import REQUEST_TIMEOUT, connect  # noqa: E402

pytestmark = pytest.mark.rpc


def weighted() -> GraphBuilder:
    g = GraphBuilder()
    x, w = g.input("x"), g.input("w", param=True)
    g.output(g.op("add", [x, w]))
    return g


def test_bad_arguments_are_hgrt_errors_and_the_session_stays(rpc_env, lib_path):
    remote = connect(rpc_env)
    m = hgrt.create(weighted().json(), lib_path, [remote.cpu(0)])
    m.load_params({"w": np.ones(N, "float32")})
    with pytest.raises(InputError, match="input index 99 out of range"):
        m._call("set_input_bytes", 99, b"")  # an IndexError of the server before
    with pytest.raises(ParamError, match="not in TVM's save_param_dict format"):
        m.share_params(m, b"junk")  # a raw tvm InternalError before
    for bad in ((10**9, 10**9, 0), (2**70, 1, 1), (0, 1, 1)):
        with pytest.raises(InputError, match="benchmark"):
            m.benchmark(*bad)  # 10**9 runs held the server; 2**70 marked the session lost
    with pytest.raises(hgrt.RemoteError, match="failed: "):
        m._call("set_input_bytes", 2**70, b"")  # cannot cross RPC: a failure here, not there
    m.run(x=np.ones(N, "float32"))  # the session is not marked lost by any of the above
    np.testing.assert_array_equal(m.get_output(0).numpy(), 2)
    create = remote.get_function("hgrt.remote.create")
    with pytest.raises(Exception, match="InputError.*lib must be a module"):
        create(weighted().json(), "/etc/hostname", remote.cpu(0))  # never a path


def test_uploads_stay_in_the_work_directory_and_leave_no_copies(rpc_env, lib_path):
    remote = connect(rpc_env)
    with pytest.raises(InputError, match="plain file name"):
        hgrt.rpc.upload(remote, lib_path, name="../escaped.so")
    lib = hgrt.rpc.upload(remote, lib_path, name="probe.so")  # what create(path) does too
    with pytest.raises(Exception, match="probe.so"):
        remote.download("probe.so")  # loaded, then removed: each create left a copy before
    m = hgrt.create(weighted().json(), lib, [remote.cpu(0)])  # the module stays loaded
    m.load_params({"w": np.ones(N, "float32")})
    np.testing.assert_array_equal(m(x=np.ones(N, "float32"))[0], 2)


def test_the_remote_call_api_has_its_own_frame_and_the_local_api(rpc_env, lib_path):
    remote = connect(rpc_env)
    m = hgrt.create(weighted().json(), lib_path, [remote.cpu(0)])
    assert m.missing_params == ["w"] and m.unset_inputs == ["x"]
    m.load_params({"w": np.ones(N, "float32")})
    assert m.missing_params == []
    m.set_input(x=np.full(N, 10, "float32"))
    np.testing.assert_array_equal(m(x=np.full(N, 100, "float32"))[0], 101)
    m.run(parallel=False)  # run() still reads what set_input set, not the call's input
    np.testing.assert_array_equal(m.get_output(0).numpy(), 11)
    out = [np.empty(N, "float32")]
    assert m(x=np.zeros(N, "float32"), out=out) is out
    np.testing.assert_array_equal(out[0], 1)
    m.sync()
    m.configure_calls(callers=2)
    m.configure_streams(parallel=False)
    m.defer_params()
    assert m.missing_params == ["w"]
    with pytest.raises(ParamError, match="not loaded yet"):
        m.run()


_LONG_CLIENT = textwrap.dedent("""
    import sys, numpy as np, hgrt, hgrt.rpc
    from hgrt.testing import GraphBuilder
    tracker, key, lib, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    g = GraphBuilder(shape=(n,))
    x = g.input("x", sid=0)
    for i in range(200):
        x = g.op("add_one", [x], sids=[1 + i % 2])
    g.output(x)
    remote = hgrt.rpc.connect(tracker=tracker, key=key, timeout=30)
    m = hgrt.create(g.json(), lib, [remote.cpu(0)])
    m.set_input("x", np.zeros(n, "float32"))
    print("running", flush=True)
    m.benchmark(repeat=1000, number=1000, warmup=0)  # hours: killed long before
""")


def test_a_client_killed_during_a_long_call_frees_the_server(rpc_env, tmp_path):
    key = "hgrt-gone"
    rpc_env.start_server(key)
    n = 1 << 20
    lib = str(tmp_path / "big.so")
    elementwise_lib(n).export_library(lib)
    client = subprocess.Popen([sys.executable, "-c", _LONG_CLIENT, rpc_env.tracker, key, lib,
                               str(n)], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "running"
        time.sleep(1.0)
    finally:
        client.kill()
        client.wait()
    t0 = time.monotonic()
    remote = connect(rpc_env, key=key, timeout=REQUEST_TIMEOUT)  # "no free server" before
    assert time.monotonic() - t0 < REQUEST_TIMEOUT
    assert hgrt.rpc.stats(remote)["modules"] == 0


def test_a_server_caps_its_sessions_and_removes_their_files_when_it_stops(lib_path):
    server = serve("127.0.0.1", 9300, 9399, key="cap", max_session=3.0)
    try:
        root = server.work_root
        remote = hgrt.rpc.connect(server=f"127.0.0.1:{server.port}", key="cap")
        m = hgrt.create(add_one_chain(N, 2).json(), lib_path, [remote.cpu(0)])
        remote.upload(lib_path, "kept.so")  # a file the session leaves
        assert any(files for _, _, files in os.walk(root))
        m.set_input("x", np.zeros(N, "float32"))
        time.sleep(4.0)
        with pytest.raises(hgrt.RemoteError):
            m.run()  # the server ended the session after 3 s, the client asked for no limit
    finally:
        server.terminate()
    assert not os.path.exists(root)  # a session's work directory stayed after a stop


def test_sessions_started_as_fresh_interpreters_serve_hgrt(lib_path):
    """Where a CUDA driver is present, sessions are not forked (a process forked after TVM's
    import cannot use the GPU): a spawned session process registers hgrt's functions itself and
    serves a module as a forked one does."""
    from hgrt.rpc.listen import session_start_method

    assert session_start_method("spawn") == "spawn"
    with pytest.raises(InputError, match="session_start 'thread'"):
        serve("127.0.0.1", 9300, 9399, key="spawned", session_start="thread")
    server = serve("127.0.0.1", 9300, 9399, key="spawned", session_start="spawn")
    try:
        remote = hgrt.rpc.connect(server=f"127.0.0.1:{server.port}", key="spawned")
        with hgrt.create(add_one_chain(N, 2).json(), lib_path, [remote.cpu(0)]) as m:
            m.run(x=np.zeros(N, "float32"))
            np.testing.assert_array_equal(m.get_output(0).numpy(), 2)
            assert hgrt.rpc.stats(remote)["modules"] == 1
    finally:
        server.terminate()

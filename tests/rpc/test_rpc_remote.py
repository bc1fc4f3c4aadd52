"""Remote execution through a real TVM tracker and hgrt rpc-server processes on 127.0.0.1.

Every test opens its own session (the server serves one at a time) and drops it on return.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm
from tvm import te

import hgrt
import hgrt.rpc
from hgrt.errors import DeviceError, GraphError, InputError, RemoteError
from hgrt.testing import GraphBuilder, N, add_one_chain, conv_model, elementwise_lib

pytestmark = pytest.mark.rpc

REQUEST_TIMEOUT = 20.0  # a test that leaks its session makes the next ones fail, not hang


def two_device_graph() -> tuple[GraphBuilder, callable]:
    """x (cpu:0) -> add_one -> copy -> mul by param w (cpu:1); outputs on both devices."""
    g = GraphBuilder()
    x = g.input("x", dev=0)
    w = g.input("w", dev=1, param=True)
    a = g.op("add_one", [x], dev=0)
    b = g.copy(a, dev=1)
    y = g.op("mul", [b, w], dev=1)
    d = g.copy(y, dev=0)
    z = g.op("add", [d, x], dev=0)
    g.output(z, y)
    return g, lambda x, w: ((x + 1) * w + x, (x + 1) * w)


@pytest.fixture(scope="module")
def lib_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lib") / "lib.so")
    elementwise_lib().export_library(path)
    return path


def connect(rpc_env, key=None, **kw):
    return hgrt.rpc.connect(tracker=rpc_env.tracker, key=key or rpc_env.key,
                            timeout=kw.pop("timeout", REQUEST_TIMEOUT), **kw)


@pytest.mark.parametrize("pools", [False, True], ids=["per-storage", "arena"])
def test_two_device_graph_matches_local_run(rpc_env, lib_path, pools, rng):
    g, ref = two_device_graph()
    graph_json = g.json(pools=pools)
    x = rng.standard_normal(N).astype("float32")
    w = rng.standard_normal(N).astype("float32")
    params = tvm.runtime.save_param_dict({"w": tvm.runtime.tensor(w)})

    local = hgrt.create(graph_json, tvm.runtime.load_module(lib_path), [tvm.cpu(0), tvm.cpu(1)])
    local.load_params(params)
    local.set_input("x", x)
    local.run()

    remote = connect(rpc_env)
    lib = hgrt.rpc.upload(remote, lib_path)
    m = hgrt.create(graph_json, lib, [remote.cpu(0), remote.cpu(1)])
    assert isinstance(m, hgrt.rpc.RemoteGraphModule)
    m.load_params(params)
    m.set_input("x", x)
    m.run()
    for i in range(2):
        np.testing.assert_array_equal(m.get_output(i).numpy(), local.get_output(i).numpy())
    np.testing.assert_allclose(m.get_output(0).numpy(), ref(x, w)[0], rtol=1e-6)
    # outputs stay where the graph put them, in the server
    assert str(m.get_output(1).device).endswith("cpu:1")
    assert m.device_bytes == local.device_bytes


def test_inputs_params_outputs_api(rpc_env, lib_path, rng):
    g, ref = two_device_graph()
    remote = connect(rpc_env)
    m = hgrt.create(g.json(pools=True), hgrt.rpc.upload(remote, lib_path),
                    [remote.cpu(0), remote.cpu(1)])
    assert m.get_num_inputs() == 1 and m.get_num_outputs() == 2
    assert m.get_input_index("x") == 0 and m.get_input_index("w") == 1
    assert m.get_input_index("nope") == -1
    assert m.get_input_info() == ({"x": (N,)}, {"x": "float32"})

    x = rng.standard_normal(N).astype("float32")
    w = rng.standard_normal(N).astype("float32")
    m.load_params({"w": w})  # a dict: sent as one save_param_dict blob
    np.testing.assert_array_equal(m.get_input("w").numpy(), w)

    # set_input from numpy, then from a tensor of the session (copied inside the server)
    m.set_input("x", x)
    m.run()
    np.testing.assert_allclose(m.get_output(0).numpy(), ref(x, w)[0], rtol=1e-6)
    x2 = rng.standard_normal(N).astype("float32")
    rx = tvm.runtime.tensor(x2, remote.cpu(1))
    m.set_input(0, rx)
    rx.copyfrom(np.zeros(N, "float32"))  # the module copied it: changing it changes nothing
    m.run()
    np.testing.assert_allclose(m.get_output(0).numpy(), ref(x2, w)[0], rtol=1e-6)
    np.testing.assert_array_equal(m.get_input("x").numpy(), x2)

    # get_output into a tensor of the session, and into a local one
    out = tvm.runtime.empty((N,), "float32", remote.cpu(0))
    assert m.get_output(1, out) is out
    np.testing.assert_allclose(out.numpy(), ref(x2, w)[1], rtol=1e-6)
    local_out = tvm.runtime.empty((N,), "float32", tvm.cpu(0))
    assert m.get_output(0, out=local_out) is local_out
    np.testing.assert_allclose(local_out.numpy(), ref(x2, w)[0], rtol=1e-6)

    # params from bytes; run(**inputs)
    m.load_params(tvm.runtime.save_param_dict({"w": tvm.runtime.tensor(w * 2)}))
    m.run(x=x)
    np.testing.assert_allclose(m.get_output(1).numpy(), ref(x, w * 2)[1], rtol=1e-6)

    # hgrt's errors cross unchanged
    with pytest.raises(InputError, match="expected shape"):
        m.set_input("x", np.zeros(3, "float32"))
    with pytest.raises(hgrt.ParamError, match="'v' not found"):
        m.load_params({"v": w})
    with pytest.raises(InputError, match="out is"):
        m.get_output(0, tvm.runtime.empty((3,), "float32", remote.cpu(0)))

    r = m.benchmark(repeat=3, number=5)
    assert len(r.results) == 3 and r.median > 0

    # share_params: a second module in the same session reads the first one's weights
    m2 = hgrt.create(g.json(pools=True), m.lib, [remote.cpu(0), remote.cpu(1)])
    m2.share_params(m)
    m2.run(x=x)
    np.testing.assert_allclose(m2.get_output(1).numpy(), ref(x, w * 2)[1], rtol=1e-6)


def test_bad_graph_json_reaches_client_and_server_serves_next_session(rpc_env, lib_path):
    remote = connect(rpc_env)
    lib = hgrt.rpc.upload(remote, lib_path)
    with pytest.raises(GraphError, match="graph JSON does not parse"):
        hgrt.create('{"nodes": [', lib, [remote.cpu(0)])
    g, _ = two_device_graph()
    bad = g.doc()
    bad["nodes"][2]["attrs"]["func_name"] = "no_such_kernel"
    with pytest.raises(GraphError, match="'no_such_kernel' is not in the library"):
        hgrt.create(bad, lib, [remote.cpu(0), remote.cpu(1)])
    # the same session still works ...
    m = hgrt.create(g.json(), lib, [remote.cpu(0), remote.cpu(1)])
    m.load_params({"w": np.ones(N, "float32")})
    m.run(x=np.zeros(N, "float32"))
    del m, lib, remote
    gc.collect()
    # ... and so does the server, for the next RPC session
    remote = connect(rpc_env)
    m = hgrt.create(g.json(), hgrt.rpc.upload(remote, lib_path), [remote.cpu(0), remote.cpu(1)])
    m.load_params({"w": np.ones(N, "float32")})
    m.run(x=np.zeros(N, "float32"))
    np.testing.assert_allclose(m.get_output(0).numpy(), np.ones(N))


def test_no_server_for_key_is_a_clear_error_after_the_timeout(rpc_env):
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match=r"no free RPC server for key 'nobody'.*after 1 s.*"
                                          r"keys \[.*'hgrt-test'.*\]"):
        connect(rpc_env, key="nobody", timeout=1.0)
    assert 1.0 <= time.monotonic() - t0 < 5.0


def test_devices_of_two_sessions_or_local_and_remote_are_refused(rpc_env, lib_path):
    g, _ = two_device_graph()
    remote = connect(rpc_env)
    local_session = tvm.rpc.LocalSession()
    with pytest.raises(DeviceError, match=r"one RPC session: remote cpu:0 \(session \d+\) in "
                                          r"rpc session \d+ \(tracker"):
        hgrt.create(g.json(), lib_path, [remote.cpu(0), local_session.cpu(1)])
    with pytest.raises(DeviceError, match=r"cannot mix local and remote devices: \['cpu:1'\]"):
        hgrt.create(g.json(), lib_path, [remote.cpu(0), tvm.cpu(1)])


def _aarch64_tar(tmp_path) -> str:
    """A real aarch64 library: TVM cross-compiles it; exported as a .tar of objects (no
    aarch64 linker here), which a TVM server links itself when it loads it."""
    a = te.placeholder((N,), "float32", name="a")
    o = te.compute((N,), lambda i: a[i] + 1.0, name="o")
    mod = tvm.IRModule({"add_one": te.create_prim_func([a, o])
                        .with_attr("global_symbol", "add_one")})
    lib = tvm.tirx.build(mod, target=tvm.target.Target({"kind": "llvm",
                                                        "mtriple": "aarch64-linux-gnu"}))
    path = str(tmp_path / "lib_aarch64.tar")
    lib.export_library(path)
    return path


def test_library_for_another_architecture(rpc_env, lib_path, tmp_path):
    path = _aarch64_tar(tmp_path)
    remote = connect(rpc_env)
    # refused before upload, naming both architectures
    with pytest.raises(RemoteError, match=r"library for aarch64, but the server of rpc session "
                                          r"\d+ .* runs x86_64"):
        hgrt.rpc.upload(remote, path)
    # without the check, the server's own failure comes back, and the session goes on
    with pytest.raises(RemoteError, match=r"cannot load .*lib_aarch64.tar \(built for aarch64\)"):
        hgrt.rpc.upload(remote, path, check_arch=False)
    g, _ = two_device_graph()
    m = hgrt.create(g.json(), hgrt.rpc.upload(remote, lib_path), [remote.cpu(0), remote.cpu(1)])
    m.load_params({"w": np.ones(N, "float32")})
    m.run(x=np.zeros(N, "float32"))


_KILLER = """
import os, sys, time
time.sleep(float(sys.argv[1]))
for pid in sys.argv[2:]:
    try:
        os.kill(int(pid), 9)
    except ProcessLookupError:
        pass
print(time.time(), flush=True)
"""


def test_server_killed_during_run_is_a_remote_error_in_bounded_time(rpc_env, tmp_path):
    key = "hgrt-kill"
    server = rpc_env.start_server(key)
    n = 1 << 22
    path = str(tmp_path / "big.so")
    elementwise_lib(n).export_library(path)
    remote = connect(rpc_env, key=key)
    m = hgrt.create(add_one_chain(n, 1000).json(), hgrt.rpc.upload(remote, path), [remote.cpu(0)])
    m.set_input("x", np.zeros(n, "float32"))
    t0 = time.perf_counter()
    m.run()
    one_run = time.perf_counter() - t0
    assert one_run > 0.1, "the graph must run long enough for the kill to land inside run()"

    # Kill the server's whole tree (its session process included) from another process while
    # run() is in flight here (a TVM call holds the GIL, so a thread of ours could not).
    pids = [str(p.pid) for p in server.tree()]
    killer = subprocess.Popen([sys.executable, "-c", _KILLER, str(one_run / 3), *pids],
                              stdout=subprocess.PIPE, text=True)
    started = time.time()
    try:
        with pytest.raises(RemoteError, match=r"rpc session \d+ \(tracker .*key 'hgrt-kill'.*\): "
                                              r"run failed, the server is unreachable or died"):
            m.run()
        failed = time.time()
    finally:
        killed = float(killer.communicate(timeout=30)[0])
        server.kill()  # reap what is left
    assert started < killed < failed < killed + 10.0, (started, killed, failed)
    # later calls fail at once, naming the session
    with pytest.raises(RemoteError, match="session was lost earlier"):
        m.run()


def test_hgrt_run_cli_on_a_remote_server(rpc_env, lib_path, tmp_path, rng):
    g, ref = two_device_graph()
    w = rng.standard_normal(N).astype("float32")
    x = rng.standard_normal(N).astype("float32")
    art = str(tmp_path / "art")
    hgrt.save(art, g.json(pools=True), elementwise_lib(), {"w": w})
    np.save(tmp_path / "x.npy", x)
    out = str(tmp_path / "y.npz")
    proc = subprocess.run(
        [sys.executable, "-m", "hgrt.cli", "run", art, "--rpc-tracker", rpc_env.tracker,
         "--rpc-key", rpc_env.key, "--device", "cpu:0", "--device", "cpu:1",
         "--input", f"x={tmp_path / 'x.npy'}", "--save-output", out],
        capture_output=True, text=True, timeout=120, env={**os.environ})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    y = np.load(out)
    np.testing.assert_allclose(y["arr_0"], ref(x, w)[0], rtol=1e-6)
    np.testing.assert_allclose(y["arr_1"], ref(x, w)[1], rtol=1e-6)


def test_model_compiled_with_hgrt_build_matches_local(rpc_env, tmp_path, rng):
    model = conv_model()
    result = hgrt.build(model, ["cpu:0", "cpu:1"],
                        hgrt.Placement(rules={"nn.conv2d": "cpu:1"}, preferred="cpu:0"))
    assert set(result.graph.device_index) == {0, 1}
    art = hgrt.save(str(tmp_path / "conv"), result)
    x = rng.standard_normal((1, 3, 8, 8)).astype("float32")

    local = hgrt.load(art, [tvm.cpu(0), tvm.cpu(1)])
    local.run(x=x)
    remote = connect(rpc_env)
    m = hgrt.load(art, ["cpu:0", "cpu:1"], session=remote)
    assert m.get_input_info() == local.get_input_info()
    m.run(x=x)
    np.testing.assert_array_equal(m.get_output(0).numpy(), local.get_output(0).numpy())

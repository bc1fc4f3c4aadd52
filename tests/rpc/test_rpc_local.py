"""Remote execution over ``tvm.rpc.LocalSession()``: the whole client/server path, in-process.

Tensors, functions and errors cross the RPC layer as they do over a socket, without processes.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import tvm

import hgrt
import hgrt.rpc
from hgrt.devices import machine_arch
from hgrt.errors import DeviceError, GraphError, InputError, RemoteError
from hgrt.rpc.client import RemoteGraphModule
from hgrt.rpc.session import library_machine
from hgrt.testing import GraphBuilder, N, elementwise_lib


@pytest.fixture(scope="module")
def session():
    return tvm.rpc.LocalSession()


@pytest.fixture(scope="module")
def remote_lib(session, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lib") / "lib.so")
    elementwise_lib().export_library(path)
    return hgrt.rpc.upload(session, path)


def graph():
    g = GraphBuilder()
    x = g.input("x", dev=0)
    w = g.input("w", dev=1, param=True)
    b = g.copy(g.op("add_one", [x], dev=0), dev=1)
    y = g.op("mul", [b, w], dev=1)
    z = g.op("add", [g.copy(y, dev=0), x], dev=0)
    g.output(z, y)
    return g


@pytest.mark.parametrize("pools", [False, True], ids=["per-storage", "arena"])
def test_local_session_matches_local_run(session, remote_lib, pools, rng):
    g = graph()
    x = rng.standard_normal(N).astype("float32")
    w = rng.standard_normal(N).astype("float32")
    local = hgrt.create(g.json(pools=pools), elementwise_lib(), [tvm.cpu(0), tvm.cpu(1)])
    m = hgrt.create(g.json(pools=pools), remote_lib, [session.cpu(0), session.cpu(1)])
    assert isinstance(m, RemoteGraphModule)
    for mod in (local, m):
        mod.load_params({"w": w})
        mod.run(x=x)
    for i in range(2):  # outputs at byte offsets in the arenas read back right (see rpc/views)
        np.testing.assert_array_equal(m.get_output(i).numpy(), local.get_output(i).numpy())
    out = tvm.runtime.empty((N,), "float32", session.cpu(0))
    m.get_output(0, out)
    np.testing.assert_array_equal(out.numpy(), local.get_output(0).numpy())
    m.set_input("x", tvm.runtime.tensor(x * 2, session.cpu(1)))
    m.run()
    np.testing.assert_allclose(m.get_output(1).numpy(), (2 * x + 1) * w, rtol=1e-6)
    assert m.get_input_info() == local.get_input_info()
    assert m.benchmark(repeat=2, number=2).median > 0


@pytest.mark.parametrize("pools", [False, True], ids=["per-storage", "arena"])
def test_a_concat_view_runs_remotely_as_locally(session, remote_lib, pools, rng):
    """A __concat whose pieces a kernel and a copy from cpu:1 write in place (storage 9): the
    server lays them out as the client does; the concat and a piece at byte offset 4N (both
    graph outputs) read back right."""
    g = GraphBuilder()
    x = g.input("x", dev=0)
    w = g.input("w", dev=1, param=True)
    p1 = g.op("add_one", [x], dev=0, sids=[9])
    p2 = g.copy(g.op("mul", [g.copy(x, dev=1), w], dev=1), dev=0, sid=9)
    cat = g.op("__concat", [p1, p2], dev=0, sids=[9], shapes=[(2 * N,)])
    g.output(cat, p2)
    x_v = rng.standard_normal(N).astype("float32")
    w_v = rng.standard_normal(N).astype("float32")
    want = np.concatenate([x_v + 1, x_v * w_v])
    local = hgrt.create(g.json(pools=pools), elementwise_lib(), [tvm.cpu(0), tvm.cpu(1)])
    m = hgrt.create(g.json(pools=pools), remote_lib, [session.cpu(0), session.cpu(1)])
    for mod in (local, m):
        mod.load_params({"w": w_v})
        mod.run(x=x_v)
        np.testing.assert_allclose(mod.get_output(0).numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(mod.get_output(1).numpy(), want[N:], rtol=1e-6)


def test_a_local_module_or_a_path_is_uploaded_for_you(session, tmp_path):
    g = graph()
    path = str(tmp_path / "lib.so")
    elementwise_lib().export_library(path)
    for lib in (elementwise_lib(), path):
        m = hgrt.create(g.json(), lib, [session.cpu(0), session.cpu(1)])
        m.load_params({"w": np.ones(N, "float32")})
        m.run(x=np.zeros(N, "float32"))
        np.testing.assert_array_equal(m.get_output(0).numpy(), np.ones(N))


def test_errors_cross_with_their_class(session, remote_lib):
    with pytest.raises(GraphError, match="graph JSON does not parse"):
        hgrt.create("{", remote_lib, [session.cpu(0)])
    m = hgrt.create(graph().json(), remote_lib, [session.cpu(0), session.cpu(1)])
    with pytest.raises(InputError, match="'y' not found; known: \\['x', 'w'\\]"):
        m.set_input("y", np.zeros(N, "float32"))
    with pytest.raises(hgrt.ParamError, match="'v' not found"):
        m.load_params({"v": np.zeros(N, "float32")})


def test_a_remote_run_before_the_values_are_written_is_refused(session, remote_lib):
    m = hgrt.create(graph().json(), remote_lib, [session.cpu(0), session.cpu(1)])
    with pytest.raises(hgrt.ParamError, match="weight 'w' not loaded yet"):
        m.run()
    m.load_params({"w": np.ones(N, "float32")})
    with pytest.raises(InputError, match="input 'x' never set"):
        m.run()
    m.run(x=np.ones(N, "float32"))


def test_kernel_fault_names_node_and_device_from_the_server(session, remote_lib):
    g = GraphBuilder()
    x = g.input("x", dev=0)
    g.output(g.op("add_one", [x], dev=1, name="fused_add"))  # no copy: the kernel refuses
    m = hgrt.create(g.json(), remote_lib, [session.cpu(0), session.cpu(1)])
    m.set_input("x", np.zeros(N, "float32"))
    with pytest.raises(hgrt.ExecutionError, match=r"node 1 'fused_add' \('add_one'\) on cpu:1"):
        m.run()


def test_mixing_local_and_remote_devices_is_refused(session, remote_lib):
    with pytest.raises(DeviceError, match=r"cannot mix local and remote devices: \['cpu:1'\] "
                                          r"are local, \['remote cpu:0 \(session \d+\)'\]"):
        hgrt.create(graph().json(), remote_lib, [session.cpu(0), tvm.cpu(1)])


def test_library_machine_reads_so_and_tar(tmp_path):
    path = str(tmp_path / "lib.so")
    elementwise_lib().export_library(path)
    assert library_machine(path) == machine_arch(platform.machine())
    (tmp_path / "junk.bin").write_bytes(b"not a library")
    assert library_machine(str(tmp_path / "junk.bin")) is None


def test_bad_connect_arguments():
    with pytest.raises(ValueError, match="exactly one of"):
        hgrt.rpc.connect()
    with pytest.raises(ValueError, match="HOST:PORT"):
        hgrt.rpc.connect(tracker="nohost", key="k")
    with pytest.raises(RemoteError, match="no RPC tracker answers at 127.0.0.1:1"):
        hgrt.rpc.connect(tracker="127.0.0.1:1", key="k", timeout=0.2)


def test_load_for_remote_devices_uploads_the_library_and_never_loads_it_here(
        session, tmp_path, monkeypatch, rng):
    """A library built for the server's architecture may not load on the client: hgrt.load
    uploads lib.so by path, without loading or re-exporting it in this process."""
    g = graph()
    w = rng.standard_normal(N).astype("float32")
    art = hgrt.save(str(tmp_path / "art"), g.json(pools=True), elementwise_lib(), {"w": w})

    def refuse(*args, **kwargs):
        raise AssertionError("the client loaded or exported a library")

    monkeypatch.setattr(tvm.runtime, "load_module", refuse)
    monkeypatch.setattr(tvm.runtime.Module, "export_library", refuse)
    m = hgrt.load(art, ["cpu:0", "cpu:1"], session=session)
    assert isinstance(m, RemoteGraphModule)
    x = rng.standard_normal(N).astype("float32")
    m.run(x=x)
    np.testing.assert_allclose(m.get_output(1).numpy(), (x + 1) * w, rtol=1e-6)
    with pytest.raises(hgrt.HgrtError, match="loaded or exported"):
        hgrt.load(art, ["cpu:0", "cpu:1"])  # the local path does load it (the check works)


def test_call_api_on_a_remote_module_is_thread_safe(session, remote_lib, rng):
    g = graph()
    w = rng.standard_normal(N).astype("float32")
    m = hgrt.create(g.json(pools=True), remote_lib, [session.cpu(0), session.cpu(1)])
    m.load_params({"w": w})
    xs = [rng.standard_normal(N).astype("float32") for _ in range(8)]
    want = [((x + 1) * w + x, (x + 1) * w) for x in xs]
    wrong = []

    def caller(t: int) -> None:
        for k in range(20):
            i = (t + k) % len(xs)
            got = m(x=xs[i])
            if not all(np.allclose(a, b, rtol=1e-6) for a, b in zip(got, want[i], strict=True)):
                wrong.append((t, k))

    import threading

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    out = [np.zeros(N, "float32"), np.zeros(N, "float32")]
    assert m(x=xs[0], out=out) is out
    np.testing.assert_allclose(out[1], want[0][1], rtol=1e-6)


def test_returned_bytes_are_read_as_arrays_only_when_their_count_fits():
    """What a server returns (a call's outputs, a pipeline's last stage) is read by one
    decoder: in order, by shape and dtype; a short or long answer is a RemoteError naming who
    answered, never numbers read past the end or left over."""
    from hgrt.rpc.wire import arrays_from_bytes

    a = np.arange(6, dtype="float32").reshape(2, 3)
    b = np.array([7, 8], dtype="int64")
    types = [((2, 3), "float32"), ((2,), np.dtype("int64"))]
    got = arrays_from_bytes(a.tobytes() + b.tobytes(), types, "board 1")
    assert [g.dtype for g in got] == [a.dtype, b.dtype]
    assert np.array_equal(got[0], a) and np.array_equal(got[1], b)
    for data in (a.tobytes(), a.tobytes() + b.tobytes() + b"\0"):
        with pytest.raises(RemoteError, match=r"board 1 returned \d+ bytes for outputs of 40"):
            arrays_from_bytes(data, types, "board 1")

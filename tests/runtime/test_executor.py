"""hgrt.create on hand-built graphs across tvm.cpu(0) + tvm.cpu(1)."""

import numpy as np
import pytest
import tvm

import hgrt
from hgrt.testing import GraphBuilder, N


def simplex():
    g = GraphBuilder()
    x = g.input("x", dev=0)
    a = g.op("add_one", [x], dev=0)
    b = g.copy(a, dev=1)
    y = g.op("add", [b, b], dev=1)
    g.output(y)
    return g, lambda x: (x + 1) * 2


def duplex():
    """cpu:0 -> cpu:1 -> cpu:0, with storage 1 on cpu:0 reused once its first entry is dead."""
    g = GraphBuilder()
    x = g.input("x", dev=0, sid=0)
    a = g.op("add_one", [x], dev=0, sids=[1])
    b = g.copy(a, dev=1, sid=2)
    c = g.op("add_one", [b], dev=1, sids=[3])
    d = g.copy(c, dev=0, sid=4)
    y = g.op("add", [x, d], dev=0, sids=[1])
    g.output(y)
    return g, lambda x: x + (x + 2)


@pytest.mark.parametrize("pools", [False, True], ids=["per-storage", "arena"])
@pytest.mark.parametrize("case", [simplex, duplex])
def test_two_devices_match_numpy(case, pools, lib, two_cpus, rng):
    g, ref = case()
    m = hgrt.create(g.json(pools=pools), lib, two_cpus)
    for _ in range(3):  # reruns with new inputs give new answers
        x = rng.standard_normal(N).astype("float32")
        m.set_input("x", x)
        m.run()
        np.testing.assert_allclose(m.get_output(0).numpy(), ref(x), rtol=1e-6)


def test_storage_reuse_really_shares_bytes(lib, two_cpus):
    g, _ = duplex()
    m = hgrt.create(g.json(), lib, two_cpus)
    # entries 1 and 5 share storage 1: the executor must have allocated one buffer for both
    assert m.device_bytes == [3 * 64, 2 * 64]  # cpu:0 holds storages 0, 1, 4


def test_outputs_on_different_devices(lib, two_cpus, rng):
    g = GraphBuilder()
    x = g.input("x", dev=0)
    w = g.input("w", dev=1, param=True)
    xc = g.copy(x, dev=1)
    o1, o2 = g.op("twice_out", [x], dev=0, num_outputs=2)
    p = g.op("mul", [xc, w], dev=1)
    g.output(o1, p, o2)
    m = hgrt.create(g.json(pools=True), lib, two_cpus)
    x = rng.standard_normal(N).astype("float32")
    w = rng.standard_normal(N).astype("float32")
    m.load_params(tvm.runtime.save_param_dict({"w": tvm.runtime.tensor(w)}))
    m.run(x=x)
    assert m.get_num_outputs() == 3 and m.get_num_inputs() == 1
    np.testing.assert_allclose(m.get_output(0).numpy(), x + 1, rtol=1e-6)
    np.testing.assert_allclose(m.get_output(1).numpy(), x * w, rtol=1e-6)
    np.testing.assert_allclose(m.get_output(2).numpy(), x * 2, rtol=1e-6)
    assert m.get_output(1).device == tvm.cpu(1) and m.get_output(0).device == tvm.cpu(0)
    # a call: numpy reads cpu:0's outputs through DLPack, cpu:1's come by Tensor.numpy()
    assert m._host_outputs == (True, False, True)
    got = m(x=x)
    for out, want in zip(got, (x + 1, x * w, x * 2), strict=True):
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_no_device_index_column_runs_on_first_device(lib, rng):
    g = GraphBuilder()
    x = g.input("x", dev=0)
    y = g.op("add_one", [g.op("add", [x, x])])
    g.output(y)
    m = hgrt.create(g.json(device_column=False), lib, tvm.cpu(0))
    x = rng.standard_normal(N).astype("float32")
    m.run(x=x)
    np.testing.assert_allclose(m.get_output(0).numpy(), 2 * x + 1, rtol=1e-6)
    assert m.get_output(0).device == tvm.cpu(0)


def test_flatten_data_passes_flat_views(lib, rng):
    g = GraphBuilder()
    x = g.input("x", shape=(4, 4))
    y = g.op("add_one", [x], flatten=True, shapes=[(4, 4)])
    g.output(y)
    m = hgrt.create(g.json(), lib, [tvm.cpu(0)])
    x = rng.standard_normal((4, 4)).astype("float32")
    m.run(x=x)
    assert m.get_output(0).shape == (4, 4)
    np.testing.assert_allclose(m.get_output(0).numpy(), x + 1, rtol=1e-6)
    # without flatten_data the 1-D kernel refuses the 2-D views
    g.nodes[1]["attrs"]["flatten_data"] = "0"
    m2 = hgrt.create(g.json(), lib, [tvm.cpu(0)])
    m2.set_input("x", x)
    with pytest.raises(hgrt.ExecutionError, match="node 1 'add_one_1'"):
        m2.run()


def test_nop_aliases_input(lib, rng):
    g = GraphBuilder()
    x = g.input("x", shape=(4, 4))
    v = g.op("__nop", [x], shapes=[(N,)])
    y = g.op("add_one", [v])
    g.output(y, v)
    m = hgrt.create(g.json(), lib, [tvm.cpu(0)])
    x = rng.standard_normal((4, 4)).astype("float32")
    m.run(x=x)
    np.testing.assert_allclose(m.get_output(0).numpy(), x.reshape(-1) + 1, rtol=1e-6)
    np.testing.assert_array_equal(m.get_output(1).numpy(), x.reshape(-1))


def test_missing_copy_fails_loudly_naming_node_and_device(lib, two_cpus):
    g = GraphBuilder()
    x = g.input("x", dev=0)
    y = g.op("add_one", [x], dev=1, name="fused_add")  # no copy: cpu:0 entry into a cpu:1 kernel
    g.output(y)
    m = hgrt.create(g.json(), lib, two_cpus)
    m.set_input("x", np.zeros(N, "float32"))
    with pytest.raises(hgrt.ExecutionError, match=r"node 1 'fused_add' \('add_one'\) on cpu:1"):
        m.run()


def test_api_inputs_outputs(lib, two_cpus, rng):
    g, ref = simplex()
    m = hgrt.create(g.json(), lib, two_cpus)
    assert m.get_input_index("x") == 0 and m.get_input_index("nope") == -1
    assert m.get_input_info() == ({"x": (N,)}, {"x": "float32"})
    x = rng.standard_normal(N).astype("float32")
    m.set_input(0, tvm.runtime.tensor(x, tvm.cpu(1)))  # a tensor on another device is fine
    np.testing.assert_array_equal(m.get_input("x").numpy(), x)
    np.testing.assert_array_equal(m.get_input(0).numpy(), x)
    m.run()
    out = tvm.runtime.empty((N,), "float32", tvm.cpu(0))
    assert m.get_output(0, out) is out
    np.testing.assert_allclose(out.numpy(), ref(x), rtol=1e-6)
    m.set_input({"x": x * 0})
    m.run()
    np.testing.assert_allclose(m.get_output(0).numpy(), ref(x * 0))
    r = m.benchmark(repeat=3, number=2)
    assert len(r.results) == 3 and r.median > 0 and r.mean > 0


def test_share_params_reads_the_same_weights(lib, rng):
    g = GraphBuilder()
    x = g.input("x")
    w = g.input("w", param=True)
    g.output(g.op("mul", [x, w]))
    a = hgrt.create(g.json(), lib, [tvm.cpu(0)])
    b = hgrt.create(g.json(), lib, [tvm.cpu(0)])
    w = rng.standard_normal(N).astype("float32")
    a.load_params({"w": w})
    b.share_params(a, {"w": w})
    x = rng.standard_normal(N).astype("float32")
    b.run(x=x)
    np.testing.assert_allclose(b.get_output(0).numpy(), x * w, rtol=1e-6)
    a.load_params({"w": w * 3})  # b sees the change: the tensor is shared, not copied
    b.run()
    np.testing.assert_allclose(b.get_output(0).numpy(), x * w * 3, rtol=1e-6)


def test_run_refuses_inputs_and_weights_never_written(lib, rng):
    """A pool's bytes are whatever it held: run() before an input or a weight was written
    is refused (naming it), as onnxruntime refuses a missing input, instead of a silently
    wrong result; set_input, load_params and share_params write them."""
    g = GraphBuilder()
    x = g.input("x")
    w = g.input("w", param=True)
    v = g.input("v", param=True)
    g.output(g.op("mul", [g.op("mul", [x, w]), v]))
    m = hgrt.create(g.json(), lib, [tvm.cpu(0)])
    assert m.missing_params == ["v", "w"] and m.unset_inputs == ["x"]
    xv, wv = rng.standard_normal(N).astype("float32"), rng.standard_normal(N).astype("float32")
    with pytest.raises(hgrt.ParamError, match=r"run: weight 'v' and 1 more not loaded yet "
                                              r"\(0 of 2 loaded\)"):
        m.run(x=xv)
    m.load_params({"w": wv})
    with pytest.raises(hgrt.ParamError, match=r"call: weight 'v' not loaded yet \(1 of 2"):
        m(x=xv)
    m.set_input("v", wv)  # a weight through set_input, as TVM's graph executor allows
    assert m.missing_params == [] and m.unset_inputs == []  # x came with the refused run
    m.run()
    np.testing.assert_allclose(m.get_output(0).numpy(), xv * wv * wv, rtol=1e-6)
    fresh = hgrt.create(g.json(), lib, [tvm.cpu(0)])
    fresh.share_params(m, {"w": wv})  # shares w only
    fresh.set_input("x", xv)
    with pytest.raises(hgrt.ParamError, match="'v' not loaded"):
        fresh.run()
    fresh.share_params(m)
    fresh.run()
    np.testing.assert_allclose(fresh.get_output(0).numpy(), xv * wv * wv, rtol=1e-6)
    idle = hgrt.create(g.json(), lib, [tvm.cpu(0)])
    idle.share_params(fresh)
    with pytest.raises(hgrt.InputError, match=r"run: input 'x' never set .*set_input sets it"):
        idle.run()  # weights there, no input
    unloaded = hgrt.create(g.json(), lib, [tvm.cpu(0)])
    fresh.share_params(unloaded, {"v": wv})  # another module's unwritten weight: missing
    assert fresh.missing_params == ["v"] and idle.missing_params == []


def test_save_load_round_trip(tmp_path, lib, two_cpus, rng):
    g = GraphBuilder()
    x = g.input("x", dev=0)
    w = g.input("w", dev=1, param=True)
    g.output(g.op("mul", [g.copy(x, dev=1), w], dev=1))
    w = rng.standard_normal(N).astype("float32")
    hgrt.save(str(tmp_path / "art"), g.json(pools=True), lib, {"w": w})
    assert sorted(p.name for p in (tmp_path / "art").iterdir()) == \
        ["graph.json", "lib.so", "params.bin"]
    m = hgrt.load(str(tmp_path / "art"), two_cpus)
    x = rng.standard_normal(N).astype("float32")
    m.run(x=x)
    np.testing.assert_allclose(m.get_output(0).numpy(), x * w, rtol=1e-6)


def test_load_missing_artifact_names_file(tmp_path):
    with pytest.raises(hgrt.HgrtError, match="no graph.json"):
        hgrt.load(str(tmp_path), tvm.cpu(0))


def _offset_chain():
    """x -> six add_one kernels, memory planned: entries at byte offsets of one pool."""
    from hgrt.graph import Graph
    from hgrt.relay_passes.graph.plan_memory import plan_memory

    g = GraphBuilder()
    v = g.input("x", dev=0)
    for _ in range(6):
        v = g.op("add_one", [v], dev=0)
    g.output(v)
    return plan_memory(Graph.from_json(g.json()))


def test_kernel_views_outliving_their_pools_are_freed_cleanly():
    """Steps holding kernel views at byte offsets, dropped after the pools they were made from
    (bound to a pool nobody else holds), and a module alive when the interpreter exits: every
    view owns its DLPack struct, a C allocation TVM frees with the view. (Held in the pools,
    a freed struct's deleter field was read: a segfault in 3 of 4 runs; freed by a Python
    deleter, the interpreter's shutdown crashed.)"""
    import ctypes
    import gc
    import os
    import subprocess
    import sys

    from hgrt.runtime.frames import bind_steps
    from hgrt.runtime.pools import StoragePools
    from hgrt.testing import elementwise_lib

    graph = _offset_chain()
    assert any(graph.storage_offset)  # views at byte offsets: DLPack structs of hgrt's
    lib = elementwise_lib()
    for _ in range(30):
        steps = bind_steps(graph, lib, StoragePools(graph, [tvm.cpu(0)]))
        junk = [ctypes.create_string_buffer(48) for _ in range(3000)]  # reuse freed memory
        del steps
        gc.collect()
        del junk
    code = ("import sys; sys.path.insert(0, {tests!r}); import test_executor as t, hgrt, tvm; "
            "from hgrt.testing import elementwise_lib; "
            "keep = hgrt.create(t._offset_chain().to_json(), elementwise_lib(), [tvm.cpu(0)]); "
            "keep.run(x=__import__('numpy').ones(t.N, 'float32')); print('ran')")
    run = subprocess.run([sys.executable, "-c", code.format(tests=os.path.dirname(__file__))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "ran" in run.stdout, run.stderr[-2000:]

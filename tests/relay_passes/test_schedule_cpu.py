"""The default CPU schedule: every kernel of a light model scheduled, parallel, same results."""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tvm
from tvm import tirx

from hgrt.devices import host_target
from hgrt.relay_passes.inner.cpu_schedule import schedule_cpu_functions
from hgrt.testing import fused_module, input_shape, run_lowered_vm
from hgrt.zoo import light_model

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


@pytest.fixture(scope="module")
def squeezenet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = light_model("squeezenet")
        mod, params = fused_module(model)
    return model, mod, params


@pytest.fixture(scope="module")
def scheduled(squeezenet):
    _, mod, _ = squeezenet
    return schedule_cpu_functions(mod, TARGET)


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def test_every_kernel_gets_a_schedule(squeezenet, scheduled):
    _, mod, _ = squeezenet
    new, report = scheduled
    funcs = _prim_funcs(new)
    assert report.skipped == {}
    assert sorted(report.scheduled) == sorted(funcs)
    assert all(bool(f.attrs["tirx.is_scheduled"]) for f in funcs.values())
    convs = [n for n in funcs if "conv2d" in n]
    # every conv but the first (111-wide output: no vector divisor) gets the register tile
    assert len(set(convs) & set(report.tiled)) >= len(convs) - 1
    assert not any("tirx.is_scheduled" in (f.attrs or {}) for f in _prim_funcs(mod).values())


def test_scheduled_kernels_have_parallel_loops(scheduled):
    new, _ = scheduled
    for name, f in _prim_funcs(new).items():
        if "conv2d" in name or "max_pool" in name:
            assert "T.parallel(" in f.script(), name
    assert any("T.vectorized(" in f.script() for f in _prim_funcs(new).values())


def test_outputs_unchanged(squeezenet, scheduled):
    model, mod, params = squeezenet
    new, _ = scheduled
    x = np.random.default_rng(1).standard_normal(input_shape(model)).astype("float32")
    ref = run_lowered_vm(mod, [x, *params], TARGET)
    out = run_lowered_vm(new, [x, *params], TARGET)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_deterministic_and_idempotent(squeezenet, scheduled):
    _, mod, _ = squeezenet
    new, _ = scheduled
    again = schedule_cpu_functions(mod, TARGET)[0]
    tvm.ir.assert_structural_equal(again, new)
    assert schedule_cpu_functions(new, TARGET)[0] is new  # all already scheduled: untouched


def test_other_targets_are_left_alone(squeezenet):
    _, mod, _ = squeezenet
    name = next(n for n in sorted(_prim_funcs(mod)) if n.startswith("fused_conv2d"))
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    m = mod.clone()
    m.update_func(m.get_global_var(name), m[name].with_attr("target", cuda))
    new, report = schedule_cpu_functions(m, TARGET)
    assert name in report.not_cpu
    assert new[name].same_as(m[name])
    # no target at all (neither a PrimFunc attr nor the argument): nothing is CPU, nothing changes
    bare = mod.clone()
    for gv, f in _prim_funcs(mod).items():
        bare.update_func(bare.get_global_var(gv), f.without_attr("target"))
    assert schedule_cpu_functions(bare, None)[0] is bare


def test_host_target_describes_this_machine():
    t = host_target(2)
    assert t.kind.name == "llvm" and int(t.attrs["num-cores"]) == 2
    assert host_target().attrs["num-cores"] >= 1


def test_build_schedules_every_cpu_kernel_for_this_host():
    from hgrt.compiler import lower_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, _ = lower_model(light_model("squeezenet"), ["cpu"], schedule=True)
    funcs = _prim_funcs(mod)
    cores = len(os.sched_getaffinity(0))
    for name, f in funcs.items():
        target = f.attrs["target"]
        assert target.kind.name == "llvm" and int(target.attrs["num-cores"]) == cores, name
        assert bool(f.attrs.get("tirx.is_scheduled", False)), name
        if "conv2d" in name:
            assert "T.parallel(" in f.script(), name


def _child(code: str, threads: str | None = None) -> str:
    """``code``'s stdout, run by a fresh Python with TVM_NUM_THREADS unset (or ``threads``)."""
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    if threads is not None:
        env["TVM_NUM_THREADS"] = threads
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout


def test_runtime_gives_tvm_every_usable_core_at_create_not_at_import():
    code = ("import os, hgrt, tvm; from hgrt.testing import GraphBuilder, elementwise_lib\n"
            "print(os.environ.get('TVM_NUM_THREADS', 'unset'))\n"
            "g = GraphBuilder(); g.output(g.op('add_one', [g.input('x')]))\n"
            "hgrt.create(g.json(), elementwise_lib(), tvm.cpu(0))\n"
            "print(tvm.get_global_func('runtime.NumThreads')())")
    out = _child(code).split()
    assert out[-2] == "unset"  # importing hgrt leaves the user's environment alone
    assert int(out[-1]) == len(os.sched_getaffinity(0))
    out = _child(code, threads="1").split()  # the user's choice is kept
    assert int(out[-1]) == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or os.cpu_count() > 2 *
                    len(os.sched_getaffinity(0)), reason="TVM's default pool must be smaller "
                    "than the usable cores (half the hardware threads, on a 2-vCPU VM: 1 of 2)")
def test_a_pool_tvm_started_too_small_is_reported_not_silently_half_speed():
    code = ("import warnings, tvm\n"
            "from hgrt.runtime import threads\n"
            "n = tvm.get_global_func('runtime.NumThreads')()  # a kernel started the pool\n"
            "threads.use_all_cores()  # what create does, too late for this thread\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    threads.restore_thread_count()\n"
            "print(n, threads.process_threads(), len(w), w[0].message if w else '')")
    out = _child(code).split(maxsplit=3)
    started, wanted, warned = int(out[0]), int(out[1]), int(out[2])
    assert wanted == len(os.sched_getaffinity(0))
    assert (warned == 1) == (started < wanted), out
    if warned:
        assert "TVM_NUM_THREADS" in out[3] and f"runs {started} thread" in out[3]


@pytest.mark.parametrize("stride, pad, window", [(2, 1, True), (1, 1, False), (2, 0, False)])
def test_strided_padded_pools_read_their_input_without_a_padded_copy(stride, pad, window):
    """resnet50's 3x3/2 max pool (pad 1) reads its input directly (the pad folded into the
    window's reads, no padded copy made); stride-1 or unpadded pools keep the plain schedule.
    Same numbers as unscheduled either way, max and average."""
    from onnx import TensorProto, helper

    from hgrt.testing import reference

    for op in ("MaxPool", "AveragePool"):
        node = helper.make_node(op, ["x"], ["y"], kernel_shape=[3, 3], strides=[stride] * 2,
                                pads=[pad] * 4)
        graph = helper.make_graph(
            [node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                           [1, 8, 30, 30])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod, _ = fused_module(model)
        new, _ = schedule_cpu_functions(mod, TARGET)
        pool = next(f for name, f in _prim_funcs(new).items() if "pool" in name)
        if pad:  # (unpadded pools have no padded copy to fold)
            assert ("pad_temp" in pool.script()) != window, op
        x = np.random.default_rng(3).standard_normal((1, 8, 30, 30)).astype("float32")
        np.testing.assert_allclose(run_lowered_vm(new, [x], TARGET)[0],
                                   reference(model, [x])[0], rtol=1e-5, atol=1e-5)


def _one_op_model(op: str, inputs: list, out_shape: list, opset: int = 18):
    from onnx import TensorProto, helper

    kinds = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64}
    g = helper.make_graph(
        [helper.make_node(op, [n for n, _ in inputs], ["y"])], op.lower(),
        [helper.make_tensor_value_info(n, kinds[str(a.dtype)], a.shape) for n, a in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_an_opaque_block_is_left_as_it_is_not_a_raw_index_error():
    """TVM's scatter_nd kernel is one block with no loops of its own (found by the sweep of
    the onnx node cases: ScatterND and Scatter failed with an IndexError)."""
    import hgrt
    from hgrt.testing import run_hgrt

    x = {"data": np.arange(16, dtype="float32").reshape(4, 4),
         "indices": np.array([[1], [3]], "int64"), "updates": np.ones((2, 4), "float32")}
    want = x["data"].copy()
    want[[1, 3]] = 1
    built = hgrt.build(_one_op_model("ScatterND", list(x.items()), [4, 4]), ["cpu:0"])
    np.testing.assert_array_equal(run_hgrt(built, x)[0], want)


@pytest.mark.parametrize("op", ["Cosh", "Sinh"])
@pytest.mark.parametrize("mcpu", ["haswell", None])
def test_intrinsics_llvm_cannot_vectorize_stay_scalar(op, mcpu):
    """TVM 0.27's LLVM backend has no vector form of sinh/cosh: vectorized, the build failed
    with "unknown intrinsic tirx.cosh" on every AVX2 and AVX-512 target."""
    import hgrt
    from hgrt.testing import run_hgrt

    x = np.random.default_rng(0).standard_normal((3, 4, 16)).astype("float32")
    target = {"cpu": {"kind": "llvm", "mcpu": mcpu}} if mcpu else None
    built = hgrt.build(_one_op_model(op, [("x", x)], [3, 4, 16], opset=13), ["cpu:0"],
                       target=target)
    np.testing.assert_allclose(run_hgrt(built, {"x": x})[0], getattr(np, op.lower())(x),
                               rtol=1e-5, atol=1e-6)

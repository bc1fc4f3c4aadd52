"""The step loop: native and Python loops call the same steps to the same bits, name the step
that failed, put a caller's buffers in for one run only; misaligned caller buffers are bound
where only oneDNN's kernels touch them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.providers.onednn import kernels as onednn
from hgrt.runtime import step_loop, threads
from hgrt.runtime.dispatch import dispatch
from hgrt.runtime.step_loop import StepFailed, StepLoop
from hgrt.testing import onnx_reference

NATIVE = step_loop.native_steps()
needs_native = pytest.mark.skipif(not NATIVE, reason="no native step loop here (g++, ninja)")
REASON = onednn.unavailable_reason()
needs_onednn = pytest.mark.skipif(REASON is not None, reason=f"oneDNN unavailable: {REASON}")
copy = tvm.get_global_func("runtime.TVMTensorCopyFromTo")


def _t(a) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.ascontiguousarray(a, "float32"), tvm.cpu(0))


def misaligned(a: np.ndarray, by: int = 16) -> np.ndarray:
    """A copy of ``a`` whose data starts ``by`` bytes past a multiple of 64."""
    raw = np.zeros(a.size + 32, a.dtype)
    start = ((-raw.ctypes.data % 64) + by) // a.itemsize
    out = raw[start:start + a.size].reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == by
    return out


def _chain(n: int = 4):
    """Copies a -> t1 -> ... -> tn: steps whose result shows every one ran, in order."""
    ts = [_t(np.full(8, i, "float32")) for i in range(n + 1)]
    return ts, tuple((copy, (ts[i], ts[i + 1])) for i in range(n))


@pytest.fixture(params=[True, False], ids=["native", "python"])
def native(request, monkeypatch) -> bool:
    """Each test once with the native loop (where it is built) and once with the Python loop."""
    if request.param and not NATIVE:
        pytest.skip("no native step loop here")
    if not request.param:
        monkeypatch.setattr(step_loop, "_native", lambda: None)
    return request.param


def test_the_loop_runs_every_step_in_order_and_overrides_for_one_run(native):
    ts, calls = _chain()
    loop = StepLoop(calls)
    assert (loop._native is not None) is native
    ts[0].copyfrom(np.arange(8, dtype="float32"))
    loop.run()
    assert np.array_equal(ts[-1].numpy(), np.arange(8))
    other = _t(np.full(8, 7.0))
    sink = _t(np.zeros(8))
    loop.run(((0, 0, other), (3, 1, sink)))  # read `other` first, write `sink` last
    assert np.array_equal(sink.numpy(), np.full(8, 7.0))
    assert np.array_equal(ts[-1].numpy(), np.arange(8))  # not written this run
    loop.run()  # the bound tensors are back
    assert np.array_equal(ts[-1].numpy(), np.arange(8))
    assert np.array_equal(sink.numpy(), np.full(8, 7.0))


def test_a_failing_step_is_named_and_the_overrides_are_put_back(native):
    ts, calls = _chain()
    bad = _t(np.zeros(3))  # 3 elements where 8 are copied: TVM refuses the copy
    loop = StepLoop(calls)
    with pytest.raises(StepFailed) as info:
        loop.run(((2, 1, bad),))
    assert info.value.step == 2 and "3" in str(info.value.cause)
    ts[0].copyfrom(np.full(8, 5.0, "float32"))
    loop.run()  # step 2 writes its own tensor again
    assert np.array_equal(ts[-1].numpy(), np.full(8, 5.0))


def test_a_slot_overridden_twice_gets_its_own_tensor_back(native):
    """Overrides are put back newest first: after a run that bound one argument twice, the next
    run writes the step's own tensor, not a caller's (which may be freed by then)."""
    ts, calls = _chain(1)
    loop = StepLoop(calls)
    c, d = _t(np.zeros(8)), _t(np.zeros(8))
    ts[0].copyfrom(np.full(8, 2.0, "float32"))
    loop.run(((0, 1, c), (0, 1, d)))
    ts[0].copyfrom(np.full(8, 9.0, "float32"))
    loop.run()
    assert np.array_equal(ts[1].numpy(), np.full(8, 9.0))
    assert not np.array_equal(c.numpy(), np.full(8, 9.0))


@needs_native
def test_native_overrides_are_checked():
    _, calls = _chain(2)
    loop = StepLoop(calls)
    with pytest.raises(IndexError, match="no argument 5 of step 1"):  # no step ran
        loop.run(((1, 5, _t(np.zeros(8))),))
    ts, calls = _chain(2)
    with pytest.raises(StepFailed) as info:  # a step that fails after it is named again
        StepLoop(calls).run(((1, 1, _t(np.zeros(3))),))
    assert info.value.step == 1


def test_python_functions_keep_the_loop_in_python():
    """A Python step raises its own exception type (a closed module's ClosedError)."""
    ts, calls = _chain(1)

    def boom(*_):
        raise KeyError("boom")

    loop = StepLoop(calls + ((boom, ()),))
    assert loop._native is None
    with pytest.raises(StepFailed) as info:
        loop.run()
    assert info.value.step == 1 and isinstance(info.value.cause, KeyError)


@needs_native
@pytest.mark.skipif(threads.process_threads() < 2, reason="one core: every step runs alone")
def test_solo_steps_run_alone_and_the_caller_s_pool_comes_back():
    """A solo step sees a pool of one thread; the steps around it and the caller after the
    run see the caller's share."""
    import tvm_ffi

    num_threads = tvm.get_global_func("runtime.NumThreads")
    seen: list[int] = []
    probe = tvm_ffi.convert(lambda: seen.append(num_threads()))  # an FFI function: native
    ts, calls = _chain(1)
    loop = StepLoop(((probe, ()), (threads.solo(probe), ()), calls[0], (probe, ())))
    assert loop._native is not None
    share = threads.process_threads()

    def body():
        threads.set_thread_count(share)
        ts[0].copyfrom(np.full(8, 3.0, "float32"))
        loop.run()
        return num_threads()

    assert dispatch(body, share) == share
    assert seen == [share, 1, share]
    assert np.array_equal(ts[-1].numpy(), np.full(8, 3.0))


def _conv_model() -> tuple:
    """conv 3x3 (16 -> 32) + relu, then a softmax over channels: its input is read by a
    oneDNN kernel only, its output written by a TVM kernel."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((32, 16, 3, 3)) / 12).astype("float32")
    b = rng.standard_normal(32).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Softmax", ["r"], ["y"], axis=1)]
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 20, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 20, 20])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _conv_module(kernels: str, seed: int):
    """The conv model built with ``kernels``, its module and an input."""
    model = _conv_model()
    res = hgrt.build(model, ["cpu"], kernels=kernels)
    m = hgrt.create(res.graph, res.lib, tvm.cpu(0))
    m.load_params(res.params)
    x = np.random.default_rng(seed).standard_normal((1, 16, 20, 20)).astype("float32")
    return model, m, x


@needs_onednn
def test_a_misaligned_input_only_onednn_reads_is_bound_not_copied():
    model, m, x = _conv_module("onednn", 4)
    want = onnx_reference(model, {"x": x})[0]
    eid = m._input_eids[0]
    readers = {m.graph.nodes[s.node].func_name for s in m.steps if eid in s.eids}
    assert readers == {"hgrt.onednn.conv2d"}
    loose = misaligned(x)
    assert m._zero_copy(eid, loose, inputs=True) is not None  # 16 bytes past 64: bound
    out_eid = m._output_eids[0]
    assert m._zero_copy(out_eid, misaligned(np.zeros_like(want)), inputs=False) is None
    got = m(x=loose)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.array_equal(got, m(x=np.array(x))[0])  # bound or copied: the same bits
    out = misaligned(np.zeros_like(want))  # a TVM kernel writes it: copied there
    assert m(x=loose, out=[out])[0] is out and np.array_equal(out, got)


@needs_onednn
def test_an_output_buffer_that_is_also_the_input_is_written_after_the_run():
    """``m(x=a, out=[a])`` where oneDNN alone reads ``x`` and writes ``y`` (same shape, the
    input bound in place): the output is copied in after the kernels read the input."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((256, 256)) / 16).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 256])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    res = hgrt.build(model, ["cpu"], kernels="onednn")
    m = hgrt.create(res.graph, res.lib, tvm.cpu(0))
    m.load_params(res.params)
    x = rng.standard_normal((4, 256)).astype("float32")
    want = onnx_reference(model, {"x": x})[0]
    for a in (misaligned(x), misaligned(x, by=0)):  # numpy's 16 bytes, and 64-aligned
        assert m(x=a, out=[a])[0] is a
        np.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-4)


def test_a_misaligned_input_a_tvm_kernel_reads_is_copied():
    model, m, x = _conv_module("tvm", 5)
    loose = misaligned(x)
    assert m._zero_copy(m._input_eids[0], loose, inputs=True) is None
    np.testing.assert_allclose(m(x=loose)[0], onnx_reference(model, {"x": x})[0], rtol=1e-4,
                               atol=1e-5)


@needs_native
def test_native_and_python_loops_agree_bitwise_across_threads():
    """The same module in a process without the native loop (HGRT_NATIVE_STEPS=0) gives the
    same bits, and 3 threads calling at once each get their own input's result."""
    model = _conv_model()
    res = hgrt.build(model, ["cpu"])
    m = hgrt.create(res.graph, res.lib, tvm.cpu(0))
    m.load_params(res.params)
    m.configure_calls(callers=3, threads_per_call=1)
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((1, 16, 20, 20)).astype("float32") for _ in range(3)]
    want = [m(x=x)[0] for x in xs]
    wrong = []

    def caller(i):
        for _ in range(30):
            if not np.array_equal(m(x=xs[i])[0], want[i]):
                wrong.append(i)

    ts = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert wrong == []
    frame = m._frames.take()
    assert m._loop._native is not None and frame.loop._native is not None
    m._frames.give(frame)
    script = (
        "import sys, numpy as np, onnx, tvm, hgrt\n"
        "from hgrt.runtime import step_loop\n"
        "assert not step_loop.native_steps()\n"
        "res = hgrt.build(onnx.load(sys.argv[1]), ['cpu'])\n"
        "m = hgrt.create(res.graph, res.lib, tvm.cpu(0)); m.load_params(res.params)\n"
        "m.configure_calls(callers=3, threads_per_call=1)\n"
        "xs = np.load(sys.argv[2])\n"
        "np.save(sys.argv[3], np.stack([m(x=x)[0] for x in xs]))\n")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        import onnx

        onnx.save(model, f"{tmp}/m.onnx")
        np.save(f"{tmp}/x.npy", np.stack(xs))
        subprocess.run([sys.executable, "-c", script, f"{tmp}/m.onnx", f"{tmp}/x.npy",
                        f"{tmp}/y.npy"], check=True, env={**os.environ, "HGRT_NATIVE_STEPS": "0"},
                       timeout=300)
        assert np.array_equal(np.load(f"{tmp}/y.npy"), np.stack(want))

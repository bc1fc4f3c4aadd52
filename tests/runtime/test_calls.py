"""The call API: thread-safe calls with their own activation frames and one copy of the
weights; zero-copy inputs and outputs; the stateful API refuses a second thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.lifetimes import memory_report
from hgrt.runtime import threads
from hgrt.testing import GraphBuilder, N, elementwise_lib

LAYERS, SIZE = 8, 256


def aligned(shape, dtype="float32", fill=None) -> np.ndarray:
    """A C-contiguous array whose data starts at a multiple of 64 bytes (zero-copy eligible)."""
    n = int(np.prod(shape))
    raw = np.zeros(n + 64, dtype)
    start = (-raw.ctypes.data % 64) // raw.itemsize
    arr = raw[start:start + n].reshape(shape)
    if fill is not None:
        arr[...] = fill
    return arr


def mlp_weights() -> list[np.ndarray]:
    """The MLP's weights: 8 random 256x256 matrices (seeded)."""
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((SIZE, SIZE)) / 16).astype("float32") for _ in range(LAYERS)]


WEIGHTS = mlp_weights()


def reference(x: np.ndarray) -> np.ndarray:
    """The oracle outside hgrt and TVM: numpy's relu(x @ w) layer by layer, in float64."""
    y = np.asarray(x, "float64")
    for w in WEIGHTS:
        y = np.maximum(y @ w.astype("float64"), 0.0)
    return y


def is_reference(got: np.ndarray, x: np.ndarray) -> bool:
    """``got`` is the MLP of ``x`` up to float32 rounding: rtol 1e-5 (and as much of the
    largest value for the elements that relu left near zero)."""
    want = reference(x)
    return got.shape == want.shape and np.allclose(got, want, rtol=1e-5,
                                                   atol=1e-5 * np.abs(want).max())


def assert_reference(got: np.ndarray, x: np.ndarray) -> None:
    want = reference(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.fixture(scope="module")
def mlp():
    """8 x (256x256 matmul + relu), random weights: a model whose outputs would show calls that
    mix each other's activations."""
    nodes, inits, prev = [], [], "x"
    for i, w in enumerate(WEIGHTS):
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        prev = f"r{i}"
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, SIZE])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [4, SIZE])], inits)
    res = hgrt.build(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]),
                     ["cpu"], kernels="tvm")  # runs on weights never loaded (zeros)
    m = hgrt.create(res.graph, res.lib, tvm.cpu(0))
    m.load_params(res.params)
    return m


def test_threads_get_their_own_outputs_bitwise(mlp):
    """4 threads x 200 calls on one module, different inputs: every output is numpy's MLP of
    the caller's own input, and bitwise equal to the same call made alone at the same threads
    per call."""
    mlp.configure_calls(callers=4, threads_per_call=1)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((4, SIZE)).astype("float32") for _ in range(16)]
    want = [mlp(x=x)[0] for x in xs]
    for x, y in zip(xs, want, strict=True):
        assert_reference(y, x)
    wrong, errors = [], []

    def caller(t: int) -> None:
        try:
            for k in range(200):
                i = (t * 7 + k) % len(xs)
                got = mlp(x=xs[i])[0]
                if not (is_reference(got, xs[i]) and np.array_equal(got, want[i])):
                    wrong.append((t, k))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and wrong == []
    assert 1 <= mlp._frames.made <= 4


def test_frames_share_the_weights(mlp):
    """A frame allocates the activation pool only: the weights stay one copy."""
    (mem,) = memory_report(mlp.graph)
    assert mem.weight_bytes >= LAYERS * SIZE * SIZE * 4
    assert mlp.frame_bytes == [mem.planned_bytes - mem.weight_bytes]
    frame = mlp._frames.take()
    try:
        assert frame.storage.device_bytes == mlp.frame_bytes
    finally:
        mlp._frames.give(frame)


def test_call_threads_are_the_callers_share(mlp):
    """A call's kernels run on one of hgrt's dispatchers, its pool set to the caller's share;
    the calling thread's own pool is left as it was."""
    from hgrt.runtime.dispatch import dispatch

    num_threads = tvm.get_global_func("runtime.NumThreads")
    for share in (1, 2):
        mlp.configure_calls(callers=2, threads_per_call=share)
        mine = []

        def caller(mine=mine):
            before = num_threads()
            assert_reference(mlp(x=np.ones((4, SIZE), "float32"))[0], np.ones((4, SIZE)))
            mine.append(num_threads() == before)

        t = threading.Thread(target=caller)
        t.start()
        t.join()
        assert mine == [True]
        # the dispatcher that ran it is the one a job of that share gets next
        probe = []
        t = threading.Thread(target=lambda s=share, p=probe: p.append(dispatch(num_threads, s)))
        t.start()
        t.join()
        assert probe == [min(share, threads.process_threads())]


def test_stateful_api_from_a_second_thread_is_refused(mlp):
    """A run held open (an injected slow step): set_input/run/get_output from another thread
    raise ExecutionError instead of mixing values; a call made meanwhile waits for the cores
    the run holds (the one thread budget) and reads none of the run's frame."""
    entered, release = threading.Event(), threading.Event()

    def slow_step():
        entered.set()
        release.wait(10)

    mlp.set_input("x", np.zeros((4, SIZE), "float32"))
    calls = mlp._calls
    mlp._calls = ((slow_step, ()),) + calls
    runner = threading.Thread(target=mlp.run)
    runner.start()
    try:
        assert entered.wait(10)
        x = np.random.default_rng(4).standard_normal((4, SIZE)).astype("float32")
        for call in (mlp.run, lambda: mlp.set_input("x", x), lambda: mlp.get_output(0)):
            with pytest.raises(hgrt.ExecutionError, match="another thread is using"):
                call()
        got: list = []
        caller = threading.Thread(target=lambda: got.append(mlp(x=x)))
        caller.start()
        release.set()  # the run ends; the call takes the cores it held
        caller.join(30)
        (y,) = got[0]
        assert_reference(y, x)
    finally:
        release.set()
        runner.join()
        mlp._calls = calls


def test_zero_copy_input_and_output(mlp):
    x = aligned((4, SIZE), fill=np.random.default_rng(2).standard_normal((4, SIZE)))
    want = mlp(x=np.array(x))[0]  # unaligned copy: copied in
    assert_reference(want, x)
    out = aligned((4, SIZE))
    got = mlp(x=x, out=[out])
    assert got[0] is out and np.array_equal(out, want)
    mlp.run(x=x)  # the stateful API after a zero-copy call: its own storage, its own result
    assert np.array_equal(mlp.get_output(0).numpy(), want)
    unaligned = np.zeros(4 * SIZE + 1, "float32")[1:].reshape(4, SIZE)
    mlp(x=x, out=[unaligned])  # not zero-copy eligible: written by a copy
    assert np.array_equal(unaligned, want)


def test_input_that_is_also_an_output(rng):
    g = GraphBuilder()
    x = g.input("x")
    g.output(g.op("add_one", [x]), x)
    m = hgrt.create(g.json(), elementwise_lib(), tvm.cpu(0))
    xv = aligned((N,), fill=rng.standard_normal(N))
    outs = [aligned((N,)), aligned((N,))]
    m(x=xv, out=outs)
    np.testing.assert_array_equal(outs[0], xv + 1)
    np.testing.assert_array_equal(outs[1], xv)
    y, same = m(x=xv)
    np.testing.assert_array_equal(same, xv)
    assert same.ctypes.data != xv.ctypes.data  # a new array, not the caller's


def test_call_errors(mlp):
    with pytest.raises(hgrt.InputError, match=r"no value for inputs \['x'\]"):
        mlp()
    param = mlp.graph.params[0]  # a weight (w0 stored packed: w0_col64 on AVX-512)
    with pytest.raises(hgrt.InputError, match="is a parameter"):
        mlp(**{"x": np.zeros((4, SIZE), "float32"), param: np.zeros(1, "float32")})
    with pytest.raises(hgrt.InputError, match="out must be a list of 1"):
        mlp(x=np.zeros((4, SIZE), "float32"), out=[])
    with pytest.raises(hgrt.InputError, match="expected shape"):
        mlp(x=np.zeros((4, SIZE), "float32"), out=[np.zeros(3, "float32")])


def test_calls_read_shared_params_and_close_frees_frames(mlp):
    x = np.random.default_rng(3).standard_normal((4, SIZE)).astype("float32")
    want = mlp(x=x)[0]
    assert_reference(want, x)
    other = hgrt.create(mlp.graph, mlp.lib, tvm.cpu(0))  # no weights of its own yet: refused
    with pytest.raises(hgrt.ParamError, match=r"call: weight .* not loaded yet \(0 of"):
        other(x=x)
    other.share_params(mlp)
    np.testing.assert_array_equal(other(x=x)[0], want)
    other.close()
    with pytest.raises(hgrt.ClosedError):
        other(x=x)


def test_a_callers_thread_share_does_not_pin_it_to_one_core():
    """TVM's default affinity mode pins a 1-thread pool's caller to core 0, so two callers
    would share one core; hgrt's setting keeps every usable core."""
    import os

    from hgrt.runtime.threads import set_thread_count

    cores = os.sched_getaffinity(0)
    seen = []

    def caller():
        set_thread_count(1)
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    assert seen == [cores]


@pytest.mark.parametrize("dtype", ["float16", "float64", "int32", "uint8"])
def test_call_results_are_the_callers_own_arrays(dtype, rng):
    """A call's outputs, read by numpy through DLPack where it can: the right values for each
    dtype and pool offset, each the caller's own array (a later call does not change it), and
    the same answer whether the inputs take the quick checks (names, numpy arrays) or not."""
    g = GraphBuilder(dtype=dtype)
    x = g.input("x")
    o1, o2 = g.op("twice_out", [g.op("add_one", [x])], num_outputs=2)
    g.output(o1, o2, x)  # (x: an input returned as an output, copied)
    m = hgrt.create(g.json(pools=True), elementwise_lib(dtype=dtype), tvm.cpu(0))
    assert m._host_outputs == (True, True, True)
    assert any(m._storage.offset[e] for e in m._output_eids)  # (an output inside its pool)

    def want(v):
        return [v + 2, (v + 1) * 2, v]

    xs = [(rng.uniform(0, 50, N)).astype(dtype) for _ in range(2)]
    first = m(x=xs[0])
    assert [o.dtype for o in first] == [np.dtype(dtype)] * 3
    for got, w in zip(first, want(xs[0]), strict=True):
        np.testing.assert_array_equal(got, w)
    keep = [o.copy() for o in first]
    second = m({0: list(xs[1])})  # an index and a list: the general checks
    for got, w in zip(second, want(xs[1]), strict=True):
        np.testing.assert_array_equal(got, w)
    for got, k in zip(first, keep, strict=True):  # untouched by the second call (same frame)
        np.testing.assert_array_equal(got, k)
    with pytest.raises(hgrt.InputError, match="input 'x': expected dtype"):
        m(x=xs[0].astype("float32" if dtype != "float32" else "float64"))
    with pytest.raises(hgrt.InputError, match="input 'x': expected shape"):
        m(x=xs[0][:-1])


def test_frame_pool_makes_no_more_than_its_limit_and_every_caller_gets_one():
    from hgrt.runtime.frames import FramePool

    pool = FramePool(lambda: object(), limit=2)
    held, most, lock = [], [0], threading.Lock()

    def caller():
        for _ in range(50):
            f = pool.take()
            with lock:
                held.append(f)
                most[0] = max(most[0], len(held))
            time.sleep(0.0005)  # held a while: the others must wait for it
            with lock:
                held.remove(f)
            pool.give(f)

    threads_ = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads_:
        t.start()
    for t in threads_:
        t.join(30)
    assert not any(t.is_alive() for t in threads_), "a caller waited for a frame forever"
    assert pool.made == 2 and most[0] == 2  # four callers, never more than two frames

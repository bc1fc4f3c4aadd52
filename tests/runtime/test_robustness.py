"""Faults of the runtime: each test fails on the code before its fix.

Wrong numbers (weights read through views or by call frames), crashes (misaligned plans, a
module closed under a running thread), hangs (a stream interrupted, frames given back to a pool
replaced meanwhile) and modules kept alive by reference cycles.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
import traceback
import weakref

import numpy as np
import pytest
import tvm

import hgrt
from hgrt.graph import Graph
from hgrt.testing import GraphBuilder, N, elementwise_lib
from hgrt.testing import add_one_chain as chain

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_streams import branchy, module, planned  # noqa: E402

CPU = [tvm.cpu(0)]


def create(doc, lib=None, devs=CPU):
    return hgrt.create(json.dumps(doc) if isinstance(doc, dict) else doc,
                       lib or elementwise_lib(), devs)


def weighted(view: bool) -> GraphBuilder:
    """y = x + w, w read directly or through a ``__nop`` view of it."""
    g = GraphBuilder()
    x, w = g.input("x"), g.input("w", param=True)
    g.output(g.op("add", [x, g.op("__nop", [w]) if view else w]))
    return g


def test_shared_params_reach_their_views():
    doc = weighted(view=True).doc()
    m1, m2 = create(doc), create(doc)
    m1.load_params({"w": np.full(N, 5, "float32")})
    m2.share_params(m1)
    x = np.ones(N, "float32")
    m2.run(x=x)
    np.testing.assert_array_equal(m2.get_output(0).numpy(), 6)  # was 1: w's own bytes, unset
    np.testing.assert_array_equal(m2(x=x)[0], 6)


def test_call_frames_read_the_weights_of_a_plan_without_weight_pools():
    doc = weighted(view=False).doc(pools=True)
    assert "weight_pool_bytes" not in doc["hgrt"]
    m = create(doc)
    m.load_params({"w": np.full(N, 5, "float32")})
    x = np.ones(N, "float32")
    m.run(x=x)
    np.testing.assert_array_equal(m.get_output(0).numpy(), 6)
    np.testing.assert_array_equal(m(x=x)[0], 6)  # was the frame's own, never loaded, w


@pytest.mark.parametrize("offset", [4, 32])
def test_a_misaligned_storage_offset_is_refused(offset):
    doc = chain(N, 2).doc(pools=True)
    doc["hgrt"]["storage_offset"][1] += offset
    doc["hgrt"]["pool_bytes"][0] += 64
    with pytest.raises(hgrt.GraphError, match="storage_offset.*not a multiple of 64"):
        Graph.from_json(doc)  # kernels assume aligned data: this segfaulted in run()


@pytest.mark.parametrize("shape", [[2**70], [2**62, 4], [2**61 + 1, 8]])
def test_shapes_past_int64_are_refused(shape):
    doc = chain(N, 1).doc()
    doc["attrs"]["shape"][1][1] = shape
    with pytest.raises(hgrt.GraphError, match="more than hgrt allocates"):
        Graph.from_json(doc)  # numpy's int64 product wrapped: [2**62, 4] was 0 bytes


def test_stream_ids_with_a_gap_are_refused():
    doc = json.loads(planned(branchy()).to_json())
    streams = doc["hgrt"]["streams"]
    assert max(streams) == 1
    doc["hgrt"]["streams"] = [2 if s == 1 else s for s in streams]
    with pytest.raises(hgrt.GraphError, match=r"stream ids must be 0..1, got \[0, 2\]"):
        Graph.from_json(doc)  # create() raised a bare KeyError


def test_an_activation_in_a_weights_storage_is_refused():
    g = GraphBuilder()
    x, w = g.input("x", sid=0), g.input("w", param=True, sid=1)
    g.output(g.op("add", [x, g.op("add_one", [x], sids=[1])], sids=[2]))
    doc = g.doc()
    doc["attrs"]["shape"][1][1][0] = 0  # an empty parameter: its storage looked free
    with pytest.raises(hgrt.GraphError, match="uses storage 1 of parameter"):
        Graph.from_json(doc)  # every call frame shared that activation
    del w


def _long_module():
    n = 1 << 22
    doc = chain(n, 40).doc(pools=True)
    doc["hgrt"]["pool_bytes"][0] += 64  # no entry at offset 0: views do not hold the pool
    doc["hgrt"]["storage_offset"] = [o + 64 for o in doc["hgrt"]["storage_offset"]]
    m = create(doc, elementwise_lib(n))
    m.set_input("x", np.zeros(n, "float32"))
    return m


def test_close_waits_for_a_run_in_another_thread():
    m = _long_module()
    m.run()
    closer = threading.Timer(0.01, m.close)
    closer.start()
    m.run()  # segfaulted: close() freed the pools under the running kernels
    closer.join()
    np.testing.assert_array_equal(m.closed, True)
    with pytest.raises(hgrt.ClosedError):
        m.run()


def test_profile_holds_the_module_against_run_and_close(monkeypatch):
    """profile() runs the steps itself on the module's storage: a run() from another thread in
    between mixed their tensors, and close() freed the pools under them (a segfault)."""
    from hgrt.runtime import profiler

    m = _long_module()
    started, report, errors = threading.Event(), [], []
    real = profiler.profile

    def profiling(*args, **kwargs):  # entered once profile() holds whatever it holds
        started.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(profiler, "profile", profiling)
    t = threading.Thread(target=lambda: report.append(m.profile(repeat=3, warmup=0)))
    t.start()
    started.wait()
    try:
        m.run()
    except hgrt.ExecutionError as e:
        errors.append(str(e))
    m.close()  # waits for the profile
    t.join()
    assert errors and "another thread" in errors[0], errors
    assert len(report[0].ops) == 40 and m.closed


def test_profile_without_inputs_says_which():
    m = create(chain(N, 2).doc())
    with pytest.raises(hgrt.InputError, match="profile.*x"):
        m.profile(repeat=1, warmup=0)  # ran the steps on unset inputs


def test_a_closed_module_raises_a_new_error_each_time():
    m = create(chain(N, 1).doc())
    m.close()
    errors = []
    for _ in range(3):
        with pytest.raises(hgrt.ClosedError) as info:
            m.run()
        errors.append(info.value)
    assert errors[0] is not errors[1]  # one error raised again grew its traceback per call


def test_a_call_with_an_input_no_step_reads():
    g = GraphBuilder()
    x, _ = g.input("x"), g.input("unused")
    g.output(g.op("add_one", [x]))
    m = create(g.doc())
    buf = np.zeros(N + 16, "float32")
    start = (-buf.ctypes.data % 64) // 4
    unused = buf[start:start + N]  # aligned: bound in place, where a raw KeyError came
    np.testing.assert_array_equal(m(x=np.ones(N, "float32"), unused=unused)[0], 2)


def test_a_read_only_out_is_refused_before_the_call():
    m = create(chain(N, 1).doc())
    out = np.zeros(N, "float32")
    out.flags.writeable = False
    with pytest.raises(hgrt.InputError, match="read-only"):
        m(x=np.ones(N, "float32"), out=[out])


def test_an_interrupted_stream_leaves_no_worker_behind(rng):
    m, ref = module(planned(branchy())), module(planned(branchy()), parallel=False)
    runner = m._streams
    k = next(j for j, step in enumerate(runner.streams[0]) if step[4] is not None)
    step = runner.streams[0][k]

    def interrupted(*args):
        raise KeyboardInterrupt

    runner.streams[0][k] = (step[0], interrupted) + step[2:]
    with pytest.raises(KeyboardInterrupt):
        m.run(x=np.ones(N, "float32"))
    runner.streams[0][k] = step
    time.sleep(0.05)
    stacks = [traceback.extract_stack(sys._current_frames()[t.ident])
              for t in threading.enumerate() if t.name == "hgrt-stream"]
    assert stacks and not [s for s in stacks if any(f.name == "_run_stream" for f in s)], \
        "a worker is still inside the interrupted run, waiting for an event"
    for _ in range(30):  # a worker left waiting on the aborted run woke inside a later one
        x = rng.standard_normal(N).astype("float32")
        m.run(x=x)
        ref.run(x=x)
        np.testing.assert_array_equal(m.get_output(0).numpy(), ref.get_output(0).numpy())


def test_a_failure_outside_a_step_does_not_hang_the_run(monkeypatch):
    m = module(planned(branchy()))
    from hgrt.runtime import streams

    def broken(n):
        raise RuntimeError("no pool")

    monkeypatch.setattr(streams, "set_thread_count", broken)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(hgrt.ExecutionError,
                                                                  m.run, x=np.ones(N, "f4"))),
                         daemon=True)
    t.start()
    t.join(20)
    assert done, "run() hung: a worker died before it said it was done"
    assert m._streams.take_failure() is None  # the runner keeps no traceback after the raise


def test_threads_for_streams_must_be_positive_integers():
    m = module(planned(branchy()))
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(hgrt.InputError, match="positive integer"):
            m.configure_streams(threads={"cpu:0": bad, "cpu:1": 1})


def test_frames_go_back_to_their_own_pool():
    n = 1 << 21
    m = create(chain(n, 60).doc(), elementwise_lib(n))
    m.configure_calls(callers=1, threads_per_call=1, max_frames=1)  # (a core for each call)
    x = np.zeros(n, "float32")
    done = []
    a = threading.Thread(target=lambda: done.append(m(x=x)), daemon=True)
    a.start()
    time.sleep(0.005)
    b = threading.Thread(target=lambda: done.append(m(x=x)), daemon=True)
    b.start()
    time.sleep(0.005)
    m.configure_calls(callers=1, threads_per_call=1, max_frames=1)  # a new pool meanwhile
    a.join(20)
    b.join(20)
    assert len(done) == 2, "a caller waiting on the old pool never got a frame back"
    for out in done:
        np.testing.assert_array_equal(out[0], 60)


def test_a_dropped_module_is_freed_without_the_collector():
    def workers() -> int:
        return sum(t.name == "hgrt-stream" for t in threading.enumerate())

    before = workers()
    gc.disable()
    try:
        m = module(planned(branchy()))
        m.run(x=np.ones(N, "float32"))
        m(x=np.ones(N, "float32"))
        assert workers() > before
        alive, pools = weakref.ref(m), weakref.ref(m._storage)
        del m
        assert alive() is None and pools() is None  # a closure over self made a cycle
        for _ in range(50):  # its stream workers stop with it
            if workers() == before:
                break
            time.sleep(0.02)
        assert workers() == before
    finally:
        gc.enable()


@pytest.mark.parametrize("repeat, warmup", [(0, 1), (-1, 1), (1, -1), (1.5, 1)])
def test_profile_counts_are_checked(repeat, warmup):
    m = create(chain(N, 2).doc())
    m.set_input("x", np.zeros(N, "float32"))
    with pytest.raises(hgrt.InputError, match="profile: (repeat|warmup) must be an integer"):
        m.profile(repeat=repeat, warmup=warmup)  # repeat=0 ended in statistics.StatisticsError

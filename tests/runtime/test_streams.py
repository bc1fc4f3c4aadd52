"""Streams: branches on two devices run at once, events order the cross-stream edges, and the
memory plan stays right when they overlap (a plan that is right only in node order is refused)."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import numpy as np
import pytest
import tvm

import hgrt
from hgrt.graph import Graph
from hgrt.relay_passes.graph.assign_streams import assign_streams
from hgrt.relay_passes.graph.plan_memory import plan_memory
from hgrt.runtime.streams import step_cost
from hgrt.testing import GraphBuilder, N, elementwise_lib

DEVS = [tvm.cpu(0), tvm.cpu(1)]
W = np.linspace(0.5, 1.5, N, dtype="float32")  # the weight ``w`` of the graphs that have one


def branchy(depth: int = 6, even: bool = False) -> Graph:
    """x -> a chain on cpu:0 and, copied over from its first value, a chain on cpu:1; joined
    on cpu:0 (that first value must not be overwritten while cpu:1's stream copies it).
    ``even``: both chains add one (else cpu:1's also reads a weight: more work there)."""
    g = GraphBuilder()
    x = g.input("x", dev=0)
    w = g.input("w", dev=1, param=True)
    a = g.op("add_one", [x], dev=0)
    b = g.copy(a, dev=1)  # read by cpu:1's stream while cpu:0's goes on
    for i in range(depth):
        a = g.op("add_one", [a], dev=0)
        b = g.op("add_one", [b], dev=1) if even else \
            g.op("mul" if i % 2 else "add", [b, w], dev=1)
    j = g.op("add", [a, g.copy(b, dev=0)], dev=0)
    g.output(g.op("add_one", [j], dev=0))
    return Graph.from_json(g.json())


def branchy_concat(depth: int = 6) -> Graph:
    """``branchy``'s two chains joined by a concat written in place: one piece by a kernel on
    cpu:0, the other by the copy back from cpu:1's stream (storage 99 for all three)."""
    g = GraphBuilder()
    x = g.input("x", dev=0)
    w = g.input("w", dev=1, param=True)
    a = g.op("add_one", [x], dev=0)
    b = g.copy(a, dev=1)
    for i in range(depth):
        a = g.op("add_one", [a], dev=0)
        b = g.op("mul" if i % 2 else "add", [b, w], dev=1)
    pieces = [g.op("add_one", [a], dev=0, sids=[99]), g.copy(b, dev=0, sid=99)]
    g.output(g.op("__concat", pieces, dev=0, sids=[99], shapes=[(2 * N,)]))
    return Graph.from_json(g.json())


def _chains(x: np.ndarray, depth: int, even: bool) -> tuple[np.ndarray, np.ndarray]:
    a = x + np.float32(1)
    b = a.copy()
    for i in range(depth):
        a = a + np.float32(1)
        b = b + np.float32(1) if even else (b * W if i % 2 else b + W)
    return a, b


def branchy_reference(x: np.ndarray, depth: int = 6, even: bool = False) -> np.ndarray:
    """numpy's value of ``branchy``'s output (the oracle outside hgrt)."""
    a, b = _chains(x, depth, even)
    return (a + b) + np.float32(1)


def branchy_concat_reference(x: np.ndarray, depth: int = 6) -> np.ndarray:
    """numpy's value of ``branchy_concat``'s output."""
    a, b = _chains(x, depth, even=False)
    return np.concatenate([a + np.float32(1), b])


def assert_reference(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def two_chains(d0: int, d1: int) -> Graph:
    """x -> add_one; from there ``d0`` add_ones on cpu:0 and, copied over, ``d1`` on cpu:1;
    joined by an add and an add_one on cpu:0: x + 1 + d0 + x + 1 + d1 + 1."""
    g = GraphBuilder()
    a = g.op("add_one", [g.input("x", dev=0)], dev=0)
    b = g.copy(a, dev=1)
    for _ in range(d0):
        a = g.op("add_one", [a], dev=0)
    for _ in range(d1):
        b = g.op("add_one", [b], dev=1)
    g.output(g.op("add_one", [g.op("add", [a, g.copy(b, dev=0)], dev=0)], dev=0))
    return Graph.from_json(g.json())


def overlap_figure(g: Graph) -> float:
    """Summed ``step_cost`` of the steps / (streams x the costliest chain of steps), the chain
    following data edges and each stream's order (not the runner's events): 1 where the
    streams' work overlaps fully, 1 / streams where nothing overlaps."""
    finish: dict[int, float] = {}
    last: dict[int, int] = {}
    total = 0.0
    for nid, s in enumerate(g.streams):
        if s < 0:
            continue
        cost = step_cost(g, nid)
        total += cost
        before = [src for src, _, _ in g.nodes[nid].inputs if src in finish]
        before += [last[s]] if s in last else []
        finish[nid] = cost + max((finish[p] for p in before), default=0.0)
        last[s] = nid
    return total / (len(last) * max(finish.values()))


def planned(graph: Graph, **opts) -> Graph:
    return plan_memory(assign_streams(graph, **opts))


def module(graph: Graph, parallel: bool | None = True):
    """The graph's module; ``parallel``: its streams at once (None: the module's default)."""
    m = hgrt.create(graph.to_json(), elementwise_lib(), DEVS)
    if graph.params:
        m.load_params({"w": W})
    if parallel is not None:
        m.configure_streams(parallel=parallel)
    return m


def test_two_branches_get_two_streams_and_one_event_each_way():
    g = planned(branchy())
    runs = [s for s in g.streams if s >= 0]
    assert set(runs) == {0, 1}
    assert sum(len(w) for w in g.waits) == 2  # the copy to cpu:1 and the copy back
    assert Graph.from_json(g.to_json()).streams == g.streams  # kept in the JSON


def test_single_stream_option_and_a_graph_without_streams_run_as_today(rng):
    x = rng.standard_normal(N).astype("float32")
    outs = []
    for g in (branchy(), planned(branchy(), single_stream=True), planned(branchy())):
        m = module(g)
        m.run(x=x)
        outs.append(m.get_output(0).numpy())
    assert planned(branchy(), single_stream=True).streams is None
    for out in outs:
        assert_reference(out, branchy_reference(x))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("graph, reference", [(branchy, branchy_reference),
                                              (branchy_concat, branchy_concat_reference)])
def test_streams_forced_to_interleave_stay_bitwise_equal(rng, graph, reference):
    """300 runs with random sleeps injected before steps: every output equals the sequential
    run's, bit for bit, and numpy's (also where the branches meet in a concat their steps write
    in place)."""
    m = module(planned(graph()))
    assert m._streams is not None and m.parallel
    x = rng.standard_normal(N).astype("float32")
    m.run(x=x, parallel=False)
    want = m.get_output(0).numpy().copy()
    assert_reference(want, reference(x))
    jitter = random.Random(0)

    def sleepy(func):
        def call(*args):
            time.sleep(jitter.random() * 2e-4)
            return func(*args)
        return call

    runner = m._streams
    runner.streams = [[(i, sleepy(f), a, w, s) for i, f, a, w, s in items]
                      for items in runner.streams]
    for _ in range(300):
        m.run()
        np.testing.assert_array_equal(m.get_output(0).numpy(), want)


def test_a_plan_right_only_in_node_order_is_refused():
    """The sequential planner reuses bytes that a copy on the other stream may still read."""
    g = assign_streams(branchy())
    sequential = plan_memory(dataclasses.replace(g, streams=None, waits=None))
    racy = dataclasses.replace(sequential, streams=g.streams, waits=g.waits)
    with pytest.raises(hgrt.GraphError, match="share .* while both are live"):
        Graph.from_json(racy.to_json())
    ok = planned(branchy())
    seq = plan_memory(branchy())
    assert sum(ok.pool_bytes) <= 1.10 * sum(seq.pool_bytes) + 128


def test_a_missing_event_is_refused():
    g = planned(branchy())
    doc = json.loads(g.to_json())
    nid = next(i for i, w in enumerate(doc["hgrt"]["waits"]) if w)
    doc["hgrt"]["waits"][nid] = []
    with pytest.raises(hgrt.GraphError, match="with no event between them: a race"):
        Graph.from_json(json.dumps(doc))


def test_a_failing_step_stops_every_stream_and_names_its_stream(rng):
    m = module(planned(branchy()))
    runner = m._streams

    def boom(*args):
        raise RuntimeError("injected")

    idx, _, args, waits, signal = runner.streams[1][1]
    runner.streams[1][1] = (idx, boom, args, waits, signal)
    with pytest.raises(hgrt.ExecutionError, match=r"on cpu:1: injected \(stream 1\)"):
        m.run(x=rng.standard_normal(N).astype("float32"))
    m.run(parallel=False)  # the sequential path does not use the runner's steps


def test_threads_per_device_are_set_and_checked():
    m = module(planned(branchy()))
    m.configure_streams(threads={"cpu:0": 1, "cpu:1": 1})
    assert m._streams.threads == [1, 1]
    with pytest.raises(hgrt.InputError, match=r"threads for \['cuda:0'\]"):
        m.configure_streams(threads={"cuda:0": 1})


def test_a_plain_run_uses_every_core_whatever_the_calling_thread_s_pool(rng):
    """A caller whose own TVM pool was set small (not by hgrt) gets a plain run() on
    process_threads() all the same: the kernels run on a dispatcher of hgrt's, and the caller's
    pool is left as the caller set it."""
    import threading

    from hgrt.runtime import threads
    from hgrt.runtime.dispatch import dispatch

    m = module(planned(branchy(), single_stream=True))
    x = rng.standard_normal(N).astype("float32")
    m.set_input(x=x)
    num_threads = tvm.get_global_func("runtime.NumThreads")
    seen = []

    def caller():
        tvm.get_global_func("runtime.config_threadpool")(-3, 1, threads.CPUS)  # not hgrt's
        m.run()
        seen.append(num_threads())

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    assert seen == [1]
    probe = []
    t = threading.Thread(target=lambda: probe.append(dispatch(num_threads,
                                                              threads.process_threads())))
    t.start()
    t.join()
    assert probe == [threads.process_threads()]
    np.testing.assert_allclose(m.get_output(0).numpy(), branchy_reference(x), rtol=1e-6)


def test_cpu_streams_run_at_once_by_default_only_where_enough_overlaps(monkeypatch):
    """Two CPU devices share the cores: a stream gets half of them, so by default streams run
    at once only where the graph's overlap figure (``overlap_figure``) exceeds
    ``SHARED_CORES_SLOWDOWN``. Chains of 40 and 0..40 steps span figures of 0.5 to 0.95: the
    default decision flips exactly where the figure crosses the constant, whatever its value.
    ``parallel=True``, or a threads split, runs streams at once anyway."""
    from hgrt.runtime.streams import SHARED_CORES_SLOWDOWN, StreamRunner

    monkeypatch.delenv("HGRT_SEQUENTIAL", raising=False)
    graphs = [planned(two_chains(40, d)) for d in range(41)]
    figures = [overlap_figure(g) for g in graphs]
    assert [StreamRunner.pays_on_shared_cores(g) for g in graphs] == \
        [f > SHARED_CORES_SLOWDOWN for f in figures]
    below = [i for i, f in enumerate(figures) if f <= SHARED_CORES_SLOWDOWN]
    above = [i for i, f in enumerate(figures) if f > SHARED_CORES_SLOWDOWN]
    assert below and above, f"SHARED_CORES_SLOWDOWN is outside the figures {figures}"
    near_below = max(below, key=figures.__getitem__)  # the two graphs nearest the threshold
    near_above = min(above, key=figures.__getitem__)
    m = module(graphs[near_below], parallel=None)
    assert m._streams is not None and not m.parallel
    assert module(graphs[near_above], parallel=None).parallel
    assert module(graphs[near_below], parallel=True).parallel
    m.configure_streams(threads={"cpu:0": 1, "cpu:1": 1})  # a split asks for streams
    assert m.parallel and m._streams.threads == [1, 1]
    x = np.arange(N, dtype="float32")
    m.run(x=x)
    at_once = m.get_output(0).numpy().copy()
    np.testing.assert_array_equal(at_once, 2 * x + 43 + near_below)  # x+1+40 + x+1+d + 1
    m.run(x=x, parallel=False)
    np.testing.assert_array_equal(m.get_output(0).numpy(), at_once)


def test_a_chain_across_devices_runs_sequentially():
    """Streams that cannot overlap would only add hand-offs: run() stays sequential."""
    g = GraphBuilder()
    v = g.input("x", dev=0)
    for i in range(6):
        v = g.op("add_one", [g.copy(v, dev=(i + 1) % 2)], dev=(i + 1) % 2)
    g.output(v)
    m = hgrt.create(planned(Graph.from_json(g.json())).to_json(), elementwise_lib(), DEVS)
    assert m._streams is None
    x = np.arange(N, dtype="float32")
    m.run(x=x)
    np.testing.assert_array_equal(m.get_output(0).numpy(), x + 6)


def test_profile_trace_has_a_track_per_stream(rng):
    m = module(planned(branchy(depth=12)))
    m.set_input("x", rng.standard_normal(N).astype("float32"))
    events = m.profile(repeat=2).chrome_trace()["traceEvents"]
    names = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert names == ["stream 0 (cpu:0)", "stream 1 (cpu:1)"]
    assert {e["tid"] for e in events if e["ph"] == "B"} == {0, 1}


def test_inspect_shows_streams():
    from hgrt.inspect import format_summary, summary

    s = summary(planned(branchy()))
    assert s["streams"]["stream 1"] == {"device": "device 1", "steps": 7, "waits": 1}
    assert "stream 0 on device 0" in format_summary(s)
    assert "none (steps run one after another)" in format_summary(summary(branchy()))

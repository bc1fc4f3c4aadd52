"""Streams at run time: each stream of the graph on a worker thread of its own, waiting only at
events, so that independent branches on two devices (or two branches of one) overlap.

TVM's FFI releases the GIL while a kernel runs, so Python threads give real parallelism. The
dispatcher that runs the call (``runtime/dispatch.py``) runs the first stream itself; the others
go to persistent workers of hgrt's (one per stream, the master of its own pools, started at the
first parallel run and again in a forked child, stopped when the runner is dropped). A failing step
stops every stream (waiters are woken) and the error names its node, device and stream.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
import weakref

from hgrt.graph import Graph
from hgrt.runtime.profiler import node_work
from hgrt.runtime.threads import set_thread_count

# A stream's kernels on a share of the cores: at 1/k of them a kernel takes ~0.9 k times as
# long (the zoo's kernels scaled 1.80-1.82x from one thread to two: BENCHMARKS.md, streams)
SHARED_CORES_SLOWDOWN = 0.9
# a byte a kernel reads or writes costs about this many FLOPs' time (2 vCPUs, AVX-512: ~300
# GFLOP/s in convolutions, ~30 GB/s in element-wise kernels on the caches' sizes)
BYTE_FLOPS = 10.0


def step_cost(graph: Graph, nid: int) -> float:
    """A step's work in FLOP units, for comparing chains of steps (not a time)."""
    flops, nbytes = node_work(graph, nid)
    return flops + BYTE_FLOPS * nbytes


def _work_and_critical_path(graph: Graph, cost) -> tuple[float, float, int]:
    """The summed ``cost(nid)`` of the steps, that of the longest chain of the happens-before
    order (stream order and the waits between streams), and the number of streams."""
    tail: dict[int, int] = {}
    finish: dict[int, float] = {}
    total = 0.0
    for nid, s in enumerate(graph.streams):
        if s >= 0:
            c = cost(nid)
            total += c
            prev = list(graph.waits[nid]) + ([tail[s]] if s in tail else [])
            finish[nid] = c + max((finish[p] for p in prev), default=0.0)
            tail[s] = nid
    return total, max(finish.values(), default=0.0), len(tail)


def _worker(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        job = None  # hold nothing of the runner between runs: it is freed with its module


def _stop(queues: list) -> None:
    for q in queues:
        q.put(None)


class StreamRunner:
    """The steps of a graph grouped by stream, with their events; ``run()`` runs them all."""

    def __init__(self, graph: Graph, steps: tuple, threads: list[int]):
        """``steps``: the module's bound steps; ``threads[s]``: kernel threads of stream s."""
        index = {step.node: i for i, step in enumerate(steps)}
        waited = {w for ws in graph.waits for w in ws}
        self.events = {n: threading.Event() for n in waited}
        n_streams = max(graph.streams) + 1
        self.streams: list[list[tuple]] = [[] for _ in range(n_streams)]
        for step in steps:
            waits = tuple(self.events[w] for w in graph.waits[step.node])
            self.streams[graph.streams[step.node]].append(
                (index[step.node], step.func, step.args, waits, self.events.get(step.node)))
        self.threads = threads
        self.stream_of = [graph.streams[step.node] for step in steps]
        self._queues: list[queue.SimpleQueue] = []
        self._pid = os.getpid()  # whose workers the queues feed (a forked child has none)
        self._failed: tuple[int, BaseException] | None = None
        self._lock = threading.Lock()

    @staticmethod
    def overlaps(graph: Graph) -> bool:
        """Whether any two steps may run at once (the longest chain of the happens-before
        order is shorter than the step count); else streams only add hand-offs."""
        total, critical, _ = _work_and_critical_path(graph, lambda nid: 1.0)
        return critical < total

    @staticmethod
    def pays_on_shared_cores(graph: Graph) -> bool:
        """Whether streams that share the same cores (CPU devices of one process: each stream
        gets a share of them) should beat one stream with all of them: the graph's total work
        exceeds ``SHARED_CORES_SLOWDOWN`` x streams x its critical path (each step weighted by
        ``step_cost``). Measured (2 vCPUs, AVX-512): light squeezenet with its convolutions on
        cpu:1 and the rest on cpu:0 (``python/main_job.py``) has little to overlap and ran
        10.2-10.9 ms with two streams of one thread against 6.0-6.3 ms as one stream of two;
        two equal branches (bench_concurrency's synthetic model) tie."""
        total, critical, streams = _work_and_critical_path(
            graph, lambda nid: step_cost(graph, nid))
        return total > SHARED_CORES_SLOWDOWN * streams * critical

    def _start(self) -> None:
        self._pid = os.getpid()
        self._queues = [queue.SimpleQueue() for _ in self.streams[1:]]
        for q in self._queues:
            threading.Thread(target=_worker, args=(q,), daemon=True,
                             name="hgrt-stream").start()
        weakref.finalize(self, _stop, list(self._queues))

    def run(self, record: list | None = None) -> None:
        """Run every stream once, returning when all have stopped; the first failure is then
        ``take_failure()``'s. ``record`` gets (step, stream, t0, t1) per step."""
        if len(self.streams) > 1 and (not self._queues or self._pid != os.getpid()):
            self._start()  # (after fork: the parent's workers do not exist in the child)
        for ev in self.events.values():
            ev.clear()
        self._failed = None
        done = [threading.Event() for _ in self._queues]
        for s, (q, ev) in enumerate(zip(self._queues, done, strict=True), start=1):
            q.put(functools.partial(self._job, s, record, ev))
        try:
            self._run_stream(0, record)
        finally:  # even when the caller's stream is interrupted: no worker outlives the run
            for ev in done:
                ev.wait()

    def take_failure(self) -> tuple[int, BaseException] | None:
        """``(step index, exception)`` of the last run's first failure, once (then None: the
        runner keeps no traceback, which would hold it in a cycle)."""
        failed, self._failed = self._failed, None
        return failed

    def _job(self, s: int, record: list | None, done: threading.Event) -> None:
        try:
            self._run_stream(s, record)
        finally:
            done.set()

    def _run_stream(self, s: int, record: list | None) -> None:
        clock = time.perf_counter
        idx = self.streams[s][0][0]
        try:
            set_thread_count(self.threads[s])
            for idx, func, args, waits, signal in self.streams[s]:
                for ev in waits:
                    ev.wait()
                if self._failed is not None:
                    return
                t0 = clock()
                func(*args)
                if record is not None:
                    record.append((idx, s, t0, clock()))
                if signal is not None:
                    signal.set()
        except BaseException as e:  # whatever it is, every other stream must stop and return
            with self._lock:
                self._failed = self._failed or (idx, e)
            for ev in self.events.values():  # wake every waiter: they see the failure
                ev.set()
            if s == 0 and not isinstance(e, Exception):
                raise  # Ctrl-C in the caller's stream: after the workers stop (``run``)

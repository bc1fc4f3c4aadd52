"""The local graph executor: ``create(graph_json, lib, devices) -> GraphModule``.

At create time the graph is validated against the devices and the library, storage is allocated
(one pool per device), and every kernel call becomes a pre-bound step ``(function, args)``.
``run()`` is then a loop over that tuple: nothing is looked up by name while running.
(``hgrt.create`` chooses between this and a module inside an RPC server.)
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import tvm
import tvm_ffi

from hgrt import devices as hdev
from hgrt.artifacts import ArtifactError, load_library
from hgrt.errors import (
    ClosedError,
    DeviceError,
    ExecutionError,
    GraphError,
    InputError,
    ParamError,
    did_you_mean,
)
from hgrt.graph import Graph
from hgrt.lifetimes import ALIGN
from hgrt.runtime.dispatch import dispatch
from hgrt.runtime.frames import (
    Frame,
    FramePool,
    Step,
    bind_steps,
    copy_tensor,
    loose_entries,
    zero_copy_view,
)
from hgrt.runtime.module_api import (
    BenchmarkResult,
    GraphModuleAPI,
    benchmark_args,
    decode_params,
)
from hgrt.runtime.pools import StoragePools
from hgrt.runtime.step_loop import StepFailed, StepLoop
from hgrt.runtime.streams import StreamRunner
from hgrt.runtime.threads import (
    CallBudget,
    process_threads,
    restore_thread_count,
    set_thread_count,
    use_all_cores,
)

_NO_FRAME = object()  # a call's job found every frame in use (``GraphModule.infer``)
# dtypes numpy takes through DLPack as they are
_DLPACK_DTYPES = frozenset(("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                            "uint8", "uint16", "uint32", "uint64"))


class GraphModule(GraphModuleAPI):
    """Runs a graph across several devices; the API of TVM's classic graph executor.

    >>> m = hgrt.create(graph_json, lib, [tvm.cpu(0), tvm.cpu(1)])   # doctest: +SKIP
    >>> m.set_input("x", x); m.run(); y = m.get_output(0).numpy()   # doctest: +SKIP
    """

    def __init__(self, graph: Graph, lib, devices: list):
        super().__init__(graph, devices)
        self.lib = lib
        _check_devices(graph, devices)
        self._storage = StoragePools(graph, devices)
        # inputs and weights never written: run() refuses while any is (their bytes are
        # whatever the pool held: a silently wrong result); set_input, load_params and
        # share_params write them
        self._unset: frozenset[str] = frozenset(self._arg_index)
        self._arg_names = list(self._arg_index)  # by input index
        self._bind_steps()
        self.configure_calls()
        self.configure_streams()

    def _bind_steps(self) -> None:
        self.steps: tuple[Step, ...] = bind_steps(self.graph, self.lib, self._storage)
        self._calls = tuple((s.func, s.args) for s in self.steps)
        self._loose = loose_entries(self.graph, self.steps)
        self._bind_plans: dict = {}  # (entry, is input) -> what ``_zero_copy`` checks a value by
        self._uses: dict[int, list[tuple[int, int]]] = {}  # entry -> (step, argument) using it
        for si, step in enumerate(self.steps):
            for pos, eid in enumerate(step.eids):
                self._uses.setdefault(eid, []).append((si, pos))

    @property
    def _calls(self) -> tuple:
        """The steps as ``(func, args)``, in order (what ``run()`` calls)."""
        return self._loop.calls

    @_calls.setter
    def _calls(self, calls: tuple) -> None:
        self._loop = StepLoop(calls)

    def _release(self) -> None:
        def refuse():  # a new error each time: one raised again would pile up tracebacks
            raise ClosedError("GraphModule is closed; create or load it again")

        self.steps, self._calls, self.lib = (), ((refuse, ()),), None  # run() raises, for free
        self._streams = self._frames = None
        self._storage = None  # the pools (unless another module shares their params)

    # ---- running ------------------------------------------------------------------------
    def run(self, parallel: bool | None = None, **inputs) -> None:
        """Run the graph once; keyword arguments are set as inputs first. A graph built with
        streams runs them at once when they can overlap and it pays (``configure_streams``
        says when; ``parallel=True`` forces it, ``parallel=False`` or ``HGRT_SEQUENTIAL=1`` runs
        the steps one after another: the same results)."""
        items = self._checked_inputs(inputs) if inputs else ()
        if not self._stateful.acquire(blocking=False):
            raise self._in_use("run")
        try:
            for idx, value in items:  # under the same claim: no other thread's input between
                self._store(idx, value)
            self._run_claimed(parallel)
        finally:
            self._stateful.release()

    def _run_claimed(self, parallel: bool | None = None, what: str = "run") -> None:
        """``run()``'s body, for a caller that holds the module's claim (``run``, ``profile``)."""
        if self._unset:
            self._check_open()
            raise self._unset_error(what)
        runner = self._streams if (self.parallel if parallel is None else parallel) else None
        if runner is None:
            dispatch(self._run_sequential, process_threads(), self._cores(process_threads()))
        else:  # the first stream runs on the dispatcher, the others on their workers
            dispatch(functools.partial(self._run_streams, runner), runner.threads[0],
                     self._cores(sum(runner.threads)))

    def _run_sequential(self) -> None:
        restore_thread_count()
        self._run_loop(self._loop)

    def _run_streams(self, runner: StreamRunner, record: list | None = None) -> None:
        runner.run(record)
        failure = runner.take_failure()
        if failure is not None:
            step, cause = failure
            if isinstance(cause, ClosedError):
                raise cause
            err = self.execution_error(step, cause)
            raise ExecutionError(f"{err} (stream {runner.stream_of[step]})") from cause

    def _trace_streams(self) -> tuple[StreamRunner, list] | None:
        """One run of the streams at once, recording (step, stream, start, end) per step; None
        when ``run()`` does not run streams at once (the profiler's stream tracks). The caller
        holds the module's claim (``profile``)."""
        if self._streams is None or not self.parallel:
            return None
        record: list = []
        self._run_streams(self._streams, record)
        return self._streams, record

    def configure_streams(self, threads: Mapping[str, int] | None = None,
                          parallel: bool | None = None) -> None:
        """Kernel threads per device for streams (``{"cpu:0": 1, "cpu:1": 1}``; default: the
        cores split evenly over the devices that have streams, then over their streams), and
        whether ``run()`` runs streams at once (default: when the graph has streams that can
        overlap, unless ``HGRT_SEQUENTIAL=1``, or unless all of them are on CPU devices, which
        share the cores, and too little overlaps to make up for each stream's smaller share:
        ``StreamRunner.pays_on_shared_cores``; ``parallel=True``, or a ``threads`` split, runs
        them at once anyway)."""
        g, self._streams, self._stream_config = self.graph, None, (threads, parallel)
        self.parallel = os.environ.get("HGRT_SEQUENTIAL", "0") in ("", "0") \
            if parallel is None else bool(parallel)
        if g.streams is None or max(g.streams, default=-1) < 1 or not StreamRunner.overlaps(g):
            return
        stream_dev: dict[int, int] = {}
        for nid, s in enumerate(g.streams):
            if s >= 0:
                stream_dev[s] = g.entry_device(g.entry_id(nid))
        devs = sorted(set(stream_dev.values()))
        if parallel is None and not threads and self.parallel \
                and all(hdev.is_local_cpu(self.devices[d]) for d in devs) \
                and not StreamRunner.pays_on_shared_cores(g):
            self.parallel = False  # CPU streams that would mostly wait: one stream, all cores
        names = [hdev.device_name(self.devices[d]) for d in devs]
        share = dict(threads or {})
        unknown = sorted(set(share) - set(names))
        if unknown:
            raise InputError(f"configure_streams: threads for {unknown}, but the streams run on "
                             f"{names}")
        for name, n in share.items():
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise InputError(f"configure_streams: threads for {name} must be a positive "
                                 f"integer, got {n!r}")
        per_dev = {d: share.get(n, max(1, process_threads() // len(devs)))
                   for d, n in zip(devs, names, strict=True)}
        counts = {d: list(stream_dev.values()).count(d) for d in devs}
        self._streams = StreamRunner(g, self.steps, [
            max(1, per_dev[stream_dev[s]] // counts[stream_dev[s]])
            for s in range(max(stream_dev) + 1)])

    def _run_loop(self, loop: StepLoop, overrides: tuple = ()) -> None:
        try:
            loop.run(overrides)
        except StepFailed as failed:
            if isinstance(failed.cause, ClosedError):
                raise failed.cause from None
            raise self.execution_error(failed.step, failed.cause) from failed.cause

    # ---- the call API: thread-safe, one frame per call ------------------------------------
    def configure_calls(self, callers: int = 1, threads_per_call: int | None = None,
                        max_frames: int | None = None) -> None:
        """How concurrent callers share the machine: each call runs its kernels on
        ``threads_per_call`` threads (default: cores // callers) in an activation frame of its
        own; at most ``max_frames`` frames (default: callers) exist, one weight copy."""
        self.budget = CallBudget(callers, threads_per_call, max_frames)
        # a partial, not a closure over self: the module must not be in a reference cycle
        # (its pools and stream workers go when the user drops it, not at the next collection)
        self._frames = FramePool(
            functools.partial(Frame, self.graph, self.lib, self.devices, self._storage),
            self.budget.frames)

    @property
    def frame_bytes(self) -> list[int]:
        """Bytes one more call frame allocates per device: activations only."""
        return Frame.bytes(self.graph, len(self.devices))

    def __call__(self, inputs: Mapping | None = None, /, *, out: list | None = None, **kw):
        """Run on ``inputs`` (a dict and/or keywords) and return the outputs: a list of numpy
        arrays, or ``out`` (a list of numpy arrays or tensors, written in place). Safe from any
        number of threads at once; ``configure_calls`` sets their share of the cores."""
        return self.infer({**(inputs or {}), **kw}, out=out)

    def infer(self, inputs: Mapping, out: list | None = None) -> list:
        """``m(inputs, out=out)``; see ``__call__``."""
        self._check_open()
        if self._unset and not self._unset.isdisjoint(self.graph.params):  # a call brings
            raise self._unset_error("call")  # every user input itself
        items = self._call_inputs(inputs)
        outs = self._call_outputs(out)
        frames = self._frames  # the frame goes back where it came from, whatever happens
        if frames is None:  # closed meanwhile
            self._check_open()
        threads = self.budget.threads
        # the frame is taken on the dispatcher, once the call has its cores: callers waiting
        # for cores hold no activations (four callers of one thread on 2 cores use two frames).
        # Should every frame be in use, the caller waits for one on its own thread, holding no
        # cores (and Ctrl-C reaches it), and hands its call over again with the frame.
        run = functools.partial(self._infer_on, frames, items, outs, threads)
        result = dispatch(run, threads, self._cores(threads))
        if result is not _NO_FRAME:
            return result
        frame = frames.take()
        try:
            return dispatch(functools.partial(run, frame=frame), threads, self._cores(threads))
        finally:
            frames.give(frame)

    def _infer_on(self, frames: FramePool, items: list, outs: list | None, threads: int,
                  frame: Frame | None = None) -> list:
        if self.closed:  # closed while this call waited for cores
            self._check_open()
        if frame is not None:
            return self._infer_in(frame, items, outs, threads)
        frame = frames.take(blocking=False)
        if frame is None:
            return _NO_FRAME
        try:
            return self._infer_in(frame, items, outs, threads)
        finally:
            frames.give(frame)

    def _cores(self, threads: int) -> int:
        """The process's cores a job of ``threads`` kernel threads holds while it runs: all of
        them on a module of CPU devices only; none where the job waits on another device
        (its host threads mostly wait: the CPU work of other calls runs meanwhile)."""
        return threads if self._host_only else 0

    @functools.cached_property
    def _host_only(self) -> bool:
        return all(hdev.is_local_cpu(d) for d in self.devices)

    def _infer_in(self, frame: Frame, items: list, outs: list | None, threads: int) -> list:
        """One call's work in ``frame``, on a dispatcher (``infer``)."""
        set_thread_count(threads)
        bound = {}
        for idx, value in items:
            eid = self._input_eids[idx]
            view = self._zero_copy(eid, value, inputs=True)
            if view is None:
                self._copy_in(frame.storage.user_view(eid), value)
            else:
                bound[eid] = view
        for i, o in enumerate(outs or ()):
            view = self._zero_copy(self._output_eids[i], o, inputs=False)
            # an output whose bytes overlap a buffer already bound (``m(x=a, out=[a])``)
            # would be written while kernels still read it: it is written by a copy after
            if view is not None and not any(_overlap(view, b) for b in bound.values()):
                bound[self._output_eids[i]] = view
        self._run_loop(frame.loop, frame.overrides(bound, self._uses))
        return self._call_results(frame, bound, outs)

    def execution_error(self, step: int, cause: Exception) -> ExecutionError:
        """The error of step ``step`` failing: names its node and the device it ran on."""
        nid = self.steps[step].node
        node = self.graph.nodes[nid]
        dev = self.devices[self.graph.entry_device(self.graph.entry_id(nid))]
        return ExecutionError(f"while executing node {nid} '{node.name}' "
                              f"('{node.func_name}') on {dev}: {cause}")

    def sync(self) -> None:
        """Wait until every device has finished the work queued on it."""
        hdev.sync(self.devices)

    def benchmark(self, repeat: int = 5, number: int = 10, warmup: int = 1) -> BenchmarkResult:
        """Time ``run()``: ``repeat`` measurements, each the mean of ``number`` runs."""
        self._check_open()
        repeat, number, warmup = benchmark_args(repeat, number, warmup)
        for _ in range(warmup):
            self.run()
        results = []
        for _ in range(repeat):
            self.sync()
            t0 = time.perf_counter()
            for _ in range(number):
                self.run()
            self.sync()
            results.append((time.perf_counter() - t0) / number)
        return BenchmarkResult(tuple(results))

    def profile(self, repeat: int = 10, warmup: int = 1):
        """Per-op times (median over ``repeat`` runs) by op and device; see ``ProfileReport``."""
        from hgrt.runtime.profiler import profile  # the profiler is loaded only when used

        benchmark_args(repeat, 1, warmup, "profile")  # (a repeat of 0: StatisticsError)
        with self._claim("profile"):  # its steps run on the module's storage: no run() between
            if self._unset:
                raise self._unset_error("profile")
            return dispatch(functools.partial(
                profile, self, functools.partial(self._run_claimed, what="profile"),
                self._trace_streams, repeat=repeat, warmup=warmup), process_threads(),
                self._cores(process_threads()))

    def _zero_copy(self, eid: int, value: Any, inputs: bool):
        """``value`` bound in place of entry ``eid`` for one call, when that is safe: no view
        shares the entry's bytes (``__nop``, ``__concat``), an input is not also an output, an
        output is written by a step and listed once; else None (copied)."""
        key = (eid, inputs)
        plan = self._bind_plans.get(key, False)
        if plan is False:
            g = self.graph
            if eid in self._viewed or (eid in self._output_eids if inputs else (
                    self._output_eids.count(eid) != 1
                    or g.nodes[g.node_of_entry(eid)].op == "null")):
                plan = None
            else:
                plan = (self.devices[g.entry_device(eid)], tuple(g.shapes[eid]), g.dtypes[eid],
                        self._align(eid))
            self._bind_plans[key] = plan
        return None if plan is None else zero_copy_view(value, *plan)

    def _align(self, eid: int) -> int:
        """Bytes a caller's buffer bound to entry ``eid`` must be aligned to."""
        return np.dtype(self.graph.dtypes[eid]).itemsize if eid in self._loose else ALIGN

    @functools.cached_property
    def _viewed(self) -> frozenset[int]:
        """Entries that share their bytes with a view (or are one): ``__nop`` views, the
        pieces of a ``__concat`` and its output."""
        roots = self.graph.alias_roots()
        shared = {r for e, r in enumerate(roots) if r != e}
        return frozenset(e for e, r in enumerate(roots) if r in shared)

    def _call_results(self, frame: Frame, bound: dict, outs: list | None) -> list:
        view = frame.storage.user_view
        if outs is None:
            return [np.from_dlpack(view(eid)).copy() if host else view(eid).numpy()
                    for eid, host in zip(self._output_eids, self._host_outputs, strict=True)]
        for o, eid, host in zip(outs, self._output_eids, self._host_outputs, strict=True):
            if eid not in bound:  # not written in place: copied there
                self._copy_out(view(eid), o, host)
        return outs

    @functools.cached_property
    def _host_outputs(self) -> tuple[bool, ...]:
        """Per output: whether numpy reads it in place through DLPack (this process's host
        memory, a dtype numpy has, bool aside), so a call's result is copied by numpy, not by
        ``Tensor.numpy()``: right after a run, light squeezenet's 4 KB output took 21 against
        77 us that way (2 vCPUs)."""
        g = self.graph
        return tuple(hdev.is_numpy_device(self.devices[g.entry_device(eid)])
                     and g.dtypes[eid] in _DLPACK_DTYPES for eid in self._output_eids)

    @staticmethod
    def _copy_in(dst, value) -> None:
        if isinstance(value, tvm.runtime.Tensor):
            copy_tensor(value, dst)
        else:
            dst.copyfrom(np.asarray(value, order="C"))

    @staticmethod
    def _copy_out(src, out, host: bool) -> None:
        """``src`` copied into the caller's ``out``; a numpy ``out`` reads ``src`` in place
        where numpy can (``host``: ``_host_outputs``)."""
        if isinstance(out, np.ndarray):
            out[...] = np.from_dlpack(src) if host else src.numpy()
        else:
            copy_tensor(src, out)

    # ---- values ---------------------------------------------------------------------------
    def _store(self, idx: int, value: Any) -> None:
        self._copy_in(self._storage.user_view(self._input_eids[idx]), value)
        if self._unset:
            self._unset -= {self._arg_names[idx]}

    def _get(self, kind: str, idx: int, out):
        with self._claim(f"get_{kind}"):
            eid = (self._input_eids if kind == "input" else self._output_eids)[idx]
            t = self._storage.user_view(eid)
            if out is not None:
                copy_tensor(t, out)
            return t if out is None else out

    # ---- params -------------------------------------------------------------------------
    def load_params(self, params: bytes | bytearray | Mapping, strict: bool = True) -> None:
        """Load parameters: bytes in TVM's ``save_param_dict`` format, or a dict of arrays.
        With ``strict`` (default), a name that is not a graph input is an error."""
        self._check_open()
        with self._claim("load_params"):
            for name, value in decode_params(params).items():
                idx = self._arg_index.get(name)
                if idx is None:
                    if strict:
                        known = self.graph.params or list(self._arg_index)
                        raise ParamError(f"param {did_you_mean(name, known)}")
                    continue
                try:
                    value = self._checked_input(idx, value, "param")
                except InputError as e:
                    raise ParamError(str(e)) from None
                self._store(idx, value)  # runs go once the last weight is here

    def defer_params(self) -> None:
        """Refuse ``run()`` and calls until every parameter has come (again) through
        ``load_params``, as a new module does until each weight is written (weights streamed
        one tensor at a time after create, as ``hgrt.Host`` does); the refusal names a missing
        weight. Checked when a weight arrives, not per step."""
        self._check_open()
        self._unset |= frozenset(self.graph.params)

    @property
    def missing_params(self) -> list[str]:
        """Parameters not loaded yet (empty: the weights are all there)."""
        return sorted(self._unset.intersection(self.graph.params))

    @property
    def unset_inputs(self) -> list[str]:
        """User inputs never set (``run()`` refuses until each has a value)."""
        return sorted(self._unset & self._user_inputs)

    def _unset_error(self, what: str) -> ParamError | InputError:
        names = self.missing_params
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            return ParamError(f"{what}: weight {names[0]!r}{more} not loaded yet "
                              f"({len(self.graph.params) - len(names)} of "
                              f"{len(self.graph.params)} loaded); load_params brings them")
        names = self.unset_inputs
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        return InputError(f"{what}: input {names[0]!r}{more} never set (its bytes would be "
                          f"whatever the pool held); set_input sets it, or run({names[0]}=...)")

    def share_params(self, other: GraphModule, params: bytes | Mapping | None = None) -> None:
        """Use ``other``'s parameter tensors (no copy): both modules then read the same weights.
        ``params`` names which ones (keys of a dict or a params blob); default: every param."""
        self._check_open()
        other._check_open()
        if not isinstance(other, GraphModule):
            raise ParamError(f"share_params: a local module shares with another local module, "
                             f"got {type(other).__name__}")
        names = list(decode_params(params)) if params is not None else list(self.graph.params)
        for name in names:
            for m in (self, other):
                if name not in m._arg_index:
                    raise ParamError(f"share_params: param "
                                     f"{did_you_mean(name, list(m._arg_index))}")
            eid = self._input_eids[self._arg_index[name]]
            oeid = other._input_eids[other._arg_index[name]]
            mine, theirs = self._storage.user_view(eid), other._storage.user_view(oeid)
            if (tuple(mine.shape), str(mine.dtype), mine.device) != \
                    (tuple(theirs.shape), str(theirs.dtype), theirs.device):
                raise ParamError(f"share_params: param {name!r} is {tuple(theirs.shape)} "
                                 f"{theirs.dtype} on {theirs.device} in the other module, "
                                 f"{tuple(mine.shape)} {mine.dtype} on {mine.device} here")
            self._storage.adopt(eid, other._storage, oeid)
        self._unset = (self._unset - set(names)) | (other._unset & set(names))
        self._bind_steps()  # steps now read the shared tensors; nothing else changes
        self.configure_streams(*self._stream_config)
        b = self.budget
        self.configure_calls(b.callers, b.threads_per_call, b.max_frames)  # frames: new weights

    # ---- introspection ------------------------------------------------------------------
    @property
    def device_bytes(self) -> list[int]:
        """Bytes of storage this module allocated on each device (0 once closed)."""
        return [0] * len(self.devices) if self.closed else list(self._storage.device_bytes)


def _check_devices(graph: Graph, devices: list) -> None:
    remote = [hdev.device_name(d) for d in devices if hdev.is_remote(d)]
    if remote:
        raise DeviceError(f"devices {remote} belong to an RPC session: hgrt.create runs a graph "
                          f"there (hgrt.runtime.executor.create is local only)")
    if graph.device_index is not None:
        for eid, d in enumerate(graph.device_index):
            if d >= len(devices):
                raise GraphError(f"entry {eid}: device_index {d} is outside the device list "
                                 f"given to create ({len(devices)} devices: "
                                 f"{[str(x) for x in devices]})")
    for i, needs in enumerate(graph.cpu_needs or ()):
        if needs is not None and i < len(devices) and hdev.is_cpu(devices[i]):
            hdev.check_runs_here(needs, hdev.device_name(devices[i]))
    if graph.pool_bytes is not None and len(graph.pool_bytes) > len(devices) \
            and any(graph.pool_bytes[len(devices):]):
        raise GraphError(f"the 'hgrt' section plans {len(graph.pool_bytes)} device pools but "
                         f"only {len(devices)} devices were given")


def create(graph_json: str | bytes | dict | Graph, lib, devices) -> GraphModule:
    """A GraphModule that runs ``graph_json`` with kernels from ``lib`` (a module or a path to
    one) on local ``devices``: ``devices[i]`` holds the entries whose ``device_index`` is ``i``;
    without that column everything runs on ``devices[0]``."""
    return create_on(graph_json, lib, hdev.normalize_devices(devices))


def create_on(graph_json: str | bytes | dict | Graph, lib, devs: list) -> GraphModule:
    """``create`` on the list of tvm Devices that ``hgrt.devices.normalize_devices`` made of
    its ``devices`` (``hgrt.create`` makes it once)."""
    graph = graph_json if isinstance(graph_json, Graph) else Graph.from_json(graph_json)
    _check_devices(graph, devs)  # first: a library built for another CPU is never loaded
    if isinstance(lib, (str, os.PathLike)):
        lib = load_library(os.fspath(lib))
    elif not isinstance(lib, tvm_ffi.Module):
        raise ArtifactError(f"lib must be a compiled library (a tvm Module, as hgrt.build "
                            f"returns it) or a path to one, got {type(lib).__name__}")
    use_all_cores()
    return GraphModule(graph, lib, devs)


def _overlap(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` share any byte."""
    def span(t):
        start = t.data_ptr()
        return start, start + int(np.prod(t.shape)) * np.dtype(str(t.dtype)).itemsize

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1

"""The graph executor: ``create(graph_json, lib, devices) -> GraphModule``.

At create time the graph is validated against the devices and the library, storage is allocated
(one pool per device), and every kernel call becomes a pre-bound step ``(function, args)``.
``run()`` is then a loop over that tuple: nothing is looked up by name while running.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm

from hgrt.errors import (
    DeviceError,
    ExecutionError,
    GraphError,
    InputError,
    ParamError,
    did_you_mean,
)
from hgrt.graph import COPY_FUNC, NOP_FUNC, Graph
from hgrt.runtime.pools import StoragePools

# TVM's thread pool starts at the first parallel kernel with TVM_NUM_THREADS workers, or else
# with half the hardware threads on x86 (it assumes two per core): one worker on a 2-vCPU VM.
# hgrt kernels are scheduled for every core this process may use, so the pool gets them all
# unless the user chose (set TVM_NUM_THREADS before importing hgrt, or before TVM's first
# parallel kernel ran).
if hasattr(os, "sched_getaffinity"):
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))

_copy_tensor = tvm.get_global_func("runtime.TVMTensorCopyFromTo")


@dataclass(frozen=True)
class BenchmarkResult:
    """Seconds per ``run()``: ``results`` holds one mean per repeat."""

    results: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.results)

    @property
    def median(self) -> float:
        return statistics.median(self.results)

    @property
    def min(self) -> float:
        return min(self.results)

    @property
    def max(self) -> float:
        return max(self.results)

    @property
    def std(self) -> float:
        return statistics.pstdev(self.results)

    def __str__(self) -> str:
        return (f"median {self.median * 1e3:.4f} ms, mean {self.mean * 1e3:.4f} ms, "
                f"std {self.std * 1e3:.4f} ms over {len(self.results)} repeats")


def normalize_devices(devices: Any) -> list:
    """One Device or a list of them -> a non-empty list of tvm Devices."""
    if isinstance(devices, tvm.runtime.Device):
        return [devices]
    try:
        devs = list(devices)
    except TypeError:
        raise DeviceError(f"devices must be a tvm Device or a list of them, got {devices!r}") \
            from None
    if not devs:
        raise DeviceError("devices is empty: give at least one device, e.g. [tvm.cpu(0)]")
    for i, d in enumerate(devs):
        if not isinstance(d, tvm.runtime.Device):
            raise DeviceError(f"devices[{i}] = {d!r} is not a tvm Device (use tvm.cpu(0), ...)")
    return devs


def _find_function(lib, name: str):
    try:
        return lib.get_function(name, query_imports=True)
    except (AttributeError, RuntimeError):
        return None


def _module_summary(lib) -> str:
    kinds = [lib.kind] + [m.kind for m in lib.imports]
    return f"module '{kinds[0]}'" + (f" and its imports {kinds[1:]}" if kinds[1:] else "")


def checked_value(value: Any, shape: Any, dtype: str, what: str) -> Any:
    """``value`` (a TVM tensor, or anything numpy takes) if its shape and dtype are the ones
    expected, as a numpy array unless it was a tensor; else an InputError naming ``what``."""
    if not isinstance(value, tvm.runtime.Tensor):
        try:
            value = np.asarray(value)
        except Exception as e:
            raise InputError(f"{what}: cannot convert {type(value).__name__} to an array: "
                             f"{e}") from e
    got_shape, got_dtype = tuple(value.shape), str(value.dtype)
    if got_shape != tuple(shape):
        raise InputError(f"{what}: expected shape {tuple(shape)}, got {got_shape}")
    if got_dtype != dtype:
        raise InputError(f"{what}: expected dtype {dtype}, got {got_dtype}")
    return value


def input_items(key: Any, value: Any, inputs: dict[str, Any], resolve
                ) -> list[tuple[int, Any]]:
    """The ``set_input`` call forms (key + value, a mapping, keywords) as (input index, value)
    pairs, every key resolved before anything is copied."""
    if isinstance(key, Mapping):
        inputs = {**key, **inputs}
    elif key is not None:
        if value is None:
            raise InputError(f"set_input({key!r}): no value given")
        inputs = {key: value, **inputs}
    return [(resolve(k), v) for k, v in inputs.items()]


class GraphModule:
    """Runs a graph across several devices; the API of TVM's classic graph executor.

    >>> m = hgrt.create(graph_json, lib, [tvm.cpu(0), tvm.cpu(1)])   # doctest: +SKIP
    >>> m.set_input("x", x); m.run(); y = m.get_output(0).numpy()   # doctest: +SKIP
    """

    def __init__(self, graph: Graph, lib, devices: list):
        self.graph = graph
        self.lib = lib
        self.devices = devices
        _check_devices(graph, devices)
        self._storage = StoragePools(graph, devices)
        self._nop_alias()
        self._steps, self._step_nodes = self._bind_steps()
        self._arg_index = {graph.nodes[n].name: i for i, n in enumerate(graph.arg_nodes)}
        self._input_eids = [graph.entry_id(n) for n in graph.arg_nodes]
        self._output_eids = [graph.entry_id(nid, idx) for nid, idx, _ in graph.heads]

    # ---- create-time binding --------------------------------------------------------------
    def _nop_alias(self) -> None:
        """A ``__nop`` node's output is a view of its input's bytes."""
        g = self.graph
        for nid, node in enumerate(g.nodes):
            if node.func_name != NOP_FUNC:
                continue
            if len(node.inputs) != 1 or node.num_outputs != 1:
                raise GraphError(f"{g.describe_node(nid)}: __nop takes one input, one output")
            src = g.entry_id(node.inputs[0][0], node.inputs[0][1])
            dst = g.entry_id(nid)
            if g.entry_device(src) != g.entry_device(dst):
                raise GraphError(f"{g.describe_node(nid)}: __nop cannot cross devices "
                                 f"({g.entry_device(src)} -> {g.entry_device(dst)}); use __copy")
            if g.entry_bytes(src) != g.entry_bytes(dst):
                raise GraphError(f"{g.describe_node(nid)}: __nop changes the byte size "
                                 f"({g.entry_bytes(src)} -> {g.entry_bytes(dst)})")
            self._storage.alias(dst, src)

    def _bind_steps(self) -> tuple[tuple, tuple]:
        g = self.graph
        steps, nodes = [], []
        for nid, node in enumerate(g.nodes):
            if node.op != "tvm_op" or node.func_name == NOP_FUNC:
                continue
            ins = [g.entry_id(i, k) for i, k, _ in node.inputs]
            outs = [g.entry_id(nid, k) for k in range(node.num_outputs)]
            if node.func_name == COPY_FUNC:
                if len(ins) != 1 or len(outs) != 1:
                    raise GraphError(f"{g.describe_node(nid)}: __copy takes one input, one output")
                if g.shapes[ins[0]] != g.shapes[outs[0]] or g.dtypes[ins[0]] != g.dtypes[outs[0]]:
                    raise GraphError(
                        f"{g.describe_node(nid)}: __copy from {g.shapes[ins[0]]} {g.dtypes[ins[0]]}"
                        f" to {g.shapes[outs[0]]} {g.dtypes[outs[0]]}: shape and dtype must match")
                steps.append((_copy_tensor, (self._storage.kernel_view(ins[0]),
                                             self._storage.kernel_view(outs[0]))))
                nodes.append(nid)
                continue
            func = _find_function(self.lib, node.func_name)
            if func is None:
                raise GraphError(f"{g.describe_node(nid)}: function {node.func_name!r} is not in "
                                 f"the library (looked in {_module_summary(self.lib)})")
            flat = node.flatten_data
            steps.append((func, tuple(self._storage.kernel_view(e, flat) for e in ins + outs)))
            nodes.append(nid)
        return tuple(steps), tuple(nodes)

    # ---- running ------------------------------------------------------------------------
    def run(self, **inputs) -> None:
        """Run the graph once; keyword arguments are set as inputs first."""
        if inputs:
            self.set_input(**inputs)
        i = 0
        try:
            for i, (func, args) in enumerate(self._steps):  # noqa: B007 - i names the fault
                func(*args)
        except Exception as e:
            raise self._execution_error(i, e) from e

    def _execution_error(self, step: int, cause: Exception) -> ExecutionError:
        nid = self._step_nodes[step]
        node = self.graph.nodes[nid]
        eid = self.graph.entry_id(nid)
        dev = self.devices[self.graph.entry_device(eid)]
        return ExecutionError(f"while executing node {nid} '{node.name}' "
                              f"('{node.func_name}') on {dev}: {cause}")

    def benchmark(self, repeat: int = 5, number: int = 10, warmup: int = 1) -> BenchmarkResult:
        """Time ``run()``: ``repeat`` measurements, each the mean of ``number`` runs."""
        for _ in range(warmup):
            self.run()
        results = []
        for _ in range(repeat):
            self._sync()
            t0 = time.perf_counter()
            for _ in range(number):
                self.run()
            self._sync()
            results.append((time.perf_counter() - t0) / number)
        return BenchmarkResult(tuple(results))

    def profile(self, repeat: int = 10, warmup: int = 1):
        """Per-op times (median over ``repeat`` runs) by op and device; see ``ProfileReport``."""
        from hgrt.runtime.profiler import profile

        return profile(self, repeat=repeat, warmup=warmup)

    def _sync(self) -> None:
        for d in self.devices:
            if d.dlpack_device_type() != 1:  # CPU work is synchronous
                d.sync()

    # ---- inputs -------------------------------------------------------------------------
    def get_input_index(self, name: str) -> int:
        """Position of input ``name`` among the graph's arg nodes, -1 if there is none."""
        return self._arg_index.get(name, -1)

    def get_num_inputs(self) -> int:
        """Number of user inputs (arg nodes that are not parameters)."""
        return len(self._arg_index) - len(self.graph.params)

    def get_num_outputs(self) -> int:
        return len(self._output_eids)

    def get_input_info(self) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
        """``(shapes, dtypes)`` of the user inputs, keyed by name, in arg order."""
        shapes, dtypes = {}, {}
        params = set(self.graph.params)
        for nid in self.graph.arg_nodes:
            name = self.graph.nodes[nid].name
            if name in params:
                continue
            eid = self.graph.entry_id(nid)
            shapes[name] = self.graph.shapes[eid]
            dtypes[name] = self.graph.dtypes[eid]
        return shapes, dtypes

    def _resolve_input(self, key: int | str) -> int:
        return resolve_input(key, self._arg_index)

    def set_input(self, key: int | str | Mapping | None = None, value: Any = None,
                  **inputs) -> None:
        """Copy values into inputs: ``set_input("x", arr)``, ``set_input(0, arr)``,
        ``set_input(x=arr, y=arr2)`` or ``set_input({"x": arr})``. numpy or TVM tensors
        (on any device, local or remote-to-local) are accepted; shape and dtype are checked."""
        for idx, val in input_items(key, value, inputs, self._resolve_input):
            self._set_one(idx, val)

    def _set_one(self, idx: int, value: Any, what: str = "input") -> None:
        eid = self._input_eids[idx]
        dst = self._storage.user_view(eid)
        name = self.graph.nodes[self.graph.arg_nodes[idx]].name
        value = checked_value(value, self.graph.shapes[eid], self.graph.dtypes[eid],
                              f"{what} {name!r}")
        if isinstance(value, tvm.runtime.Tensor):
            _copy_tensor(value, dst)
        else:
            dst.copyfrom(np.asarray(value, order="C"))

    def get_input(self, key: int | str, out=None):
        """The tensor holding input ``key`` (by name or index); copied into ``out`` if given."""
        t = self._storage.user_view(self._input_eids[self._resolve_input(key)])
        return self._maybe_copy(t, out, f"input {key!r}")

    # ---- outputs ------------------------------------------------------------------------
    def get_output(self, index: int, out=None):
        """The tensor of output ``index`` (valid until the next run); copied into ``out`` if
        given."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) \
                or not 0 <= index < len(self._output_eids):
            raise InputError(f"output index {index!r} out of range: the graph has "
                             f"{len(self._output_eids)} outputs")
        return self._maybe_copy(self._storage.user_view(self._output_eids[index]), out,
                                f"output {index}")

    @staticmethod
    def _maybe_copy(t, out, what: str):
        if out is None:
            return t
        if not isinstance(out, tvm.runtime.Tensor):
            raise InputError(f"{what}: out must be a tvm Tensor, got {type(out).__name__}")
        if tuple(out.shape) != tuple(t.shape) or str(out.dtype) != str(t.dtype):
            raise InputError(f"{what}: out is {tuple(out.shape)} {out.dtype}, expected "
                             f"{tuple(t.shape)} {t.dtype}")
        _copy_tensor(t, out)
        return out

    # ---- params -------------------------------------------------------------------------
    def load_params(self, params: bytes | bytearray | Mapping, strict: bool = True) -> None:
        """Load parameters: bytes in TVM's ``save_param_dict`` format, or a dict of arrays.
        With ``strict`` (default), a name that is not a graph input is an error."""
        params = _decode_params(params)
        for name, value in params.items():
            idx = self._arg_index.get(name)
            if idx is None:
                if strict:
                    known = self.graph.params or list(self._arg_index)
                    raise ParamError(f"param {did_you_mean(name, known)}")
                continue
            try:
                self._set_one(idx, value, what="param")
            except InputError as e:
                raise ParamError(str(e)) from None

    def share_params(self, other: GraphModule, params: bytes | Mapping | None = None) -> None:
        """Use ``other``'s parameter tensors (no copy): both modules then read the same weights.
        ``params`` names which ones (keys of a dict or a params blob); default: every param."""
        names = list(_decode_params(params)) if params is not None else list(self.graph.params)
        for name in names:
            idx, oidx = self._arg_index.get(name), other._arg_index.get(name)
            if idx is None or oidx is None:
                missing = self if idx is None else other
                raise ParamError(f"share_params: param "
                                 f"{did_you_mean(name, list(missing._arg_index))}")
            eid, oeid = self._input_eids[idx], other._input_eids[oidx]
            mine, theirs = self._storage.user_view(eid), other._storage.user_view(oeid)
            if (tuple(mine.shape), str(mine.dtype), mine.device) != \
                    (tuple(theirs.shape), str(theirs.dtype), theirs.device):
                raise ParamError(f"share_params: param {name!r} is {tuple(theirs.shape)} "
                                 f"{theirs.dtype} on {theirs.device} in the other module, "
                                 f"{tuple(mine.shape)} {mine.dtype} on {mine.device} here")
            self._storage.adopt(eid, other._storage, oeid)
        # Re-bind so steps read the shared tensors; nothing else changes.
        self._steps, self._step_nodes = self._bind_steps()

    # ---- introspection ------------------------------------------------------------------
    @property
    def device_bytes(self) -> list[int]:
        """Bytes of storage this module allocated on each device."""
        return list(self._storage.device_bytes)

    def __repr__(self) -> str:
        return (f"GraphModule({len(self.graph.nodes)} nodes, {len(self._steps)} steps, "
                f"devices={[str(d) for d in self.devices]})")


def resolve_input(key: int | str, arg_index: dict[str, int]) -> int:
    """Position of input ``key`` (a name or an index) among ``arg_index``'s inputs."""
    if isinstance(key, str):
        idx = arg_index.get(key)
        if idx is None:
            raise InputError(f"input {did_you_mean(key, list(arg_index))}")
        return idx
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        if not 0 <= key < len(arg_index):
            raise InputError(f"input index {key} out of range: the graph has "
                             f"{len(arg_index)} inputs")
        return int(key)
    raise InputError(f"input key must be a name or an index, got {key!r}")


def _decode_params(params: Any) -> dict:
    if isinstance(params, (bytes, bytearray)):
        try:
            return dict(tvm.runtime.load_param_dict(bytes(params)))
        except Exception as e:
            raise ParamError(f"params blob is not in TVM's save_param_dict format: {e}") from e
    if isinstance(params, Mapping):
        return dict(params)
    raise ParamError(f"params must be bytes or a dict of arrays, got {type(params).__name__}")


def _check_devices(graph: Graph, devices: list) -> None:
    if graph.device_index is not None:
        for eid, d in enumerate(graph.device_index):
            if d >= len(devices):
                raise GraphError(f"entry {eid}: device_index {d} is outside the device list "
                                 f"given to create ({len(devices)} devices: "
                                 f"{[str(x) for x in devices]})")
    if graph.pool_bytes is not None and len(graph.pool_bytes) > len(devices) \
            and any(graph.pool_bytes[len(devices):]):
        raise GraphError(f"the 'hgrt' section plans {len(graph.pool_bytes)} device pools but "
                         f"only {len(devices)} devices were given")


def create(graph_json: str | bytes | dict | Graph, lib, devices) -> GraphModule:
    """Create a GraphModule that runs ``graph_json`` with kernels from ``lib`` on ``devices``.

    ``devices[i]`` is the device of entries whose ``device_index`` is ``i``; without that column
    everything runs on ``devices[0]``. Devices of one TVM RPC session run the graph remotely.
    """
    devs = normalize_devices(devices)
    remote = [d.dlpack_device_type() >= 128 for d in devs]
    if any(remote):
        from hgrt.rpc.client import create_remote  # remote execution lives in hgrt.rpc

        return create_remote(graph_json, lib, devs)
    graph = graph_json if isinstance(graph_json, Graph) else Graph.from_json(graph_json)
    if isinstance(lib, str):
        lib = tvm.runtime.load_module(lib)
    return GraphModule(graph, lib, devs)

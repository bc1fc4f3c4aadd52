"""The graph-module API, once: what a user of TVM's graph executor calls, for every module.

``GraphModuleAPI`` answers everything that only needs the graph (input names and indices, input
info, output count, how ``set_input`` may be called, what ``out=`` must look like) and checks
every argument at the boundary. A module kind (the local ``GraphModule``, the ``RemoteGraphModule``
of hgrt.rpc) adds how values move: ``_store``, ``_get``, ``run``, params and benchmarks.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm

from hgrt.artifacts import iter_params
from hgrt.errors import ClosedError, ExecutionError, InputError, ParamError, did_you_mean
from hgrt.graph import Graph


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


MAX_BENCHMARK_RUNS = 10**6  # repeat, number and warmup each at most this


def benchmark_args(repeat: Any, number: Any, warmup: Any, what: str = "benchmark"
                   ) -> tuple[int, int, int]:
    """``benchmark``'s counts, checked: integers, ``repeat`` and ``number`` >= 1, ``warmup``
    >= 0, none above ``MAX_BENCHMARK_RUNS`` (a server must not be held by a typo)."""
    out = []
    for name, v, low in (("repeat", repeat, 1), ("number", number, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) \
                or not low <= v <= MAX_BENCHMARK_RUNS:
            raise InputError(f"{what}: {name} must be an integer in [{low}, "
                             f"{MAX_BENCHMARK_RUNS}], got {v!r}")
        out.append(int(v))
    return out[0], out[1], out[2]


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


def _numpy_dtype(dtype: str) -> np.dtype | None:
    """numpy's dtype of this name, None where numpy has none (bfloat16)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def decode_params(params: Any) -> dict:
    """Params as a dict: TVM ``save_param_dict`` bytes are decoded, a mapping is copied."""
    if isinstance(params, (bytes, bytearray)):
        # hgrt's reader, not TVM's load_param_dict: that one reads past the end of a truncated
        # blob and returns what lies there as weights
        return dict(iter_params(bytes(params)))
    if isinstance(params, Mapping):
        return dict(params)
    raise ParamError(f"params must be bytes or a dict of arrays, got {type(params).__name__}")


class GraphModuleAPI:
    """The part of a graph module that only needs its graph; subclasses move the values."""

    def __init__(self, graph: Graph, devices: list):
        self.graph = graph
        self.devices = devices
        self._arg_index = {graph.nodes[n].name: i for i, n in enumerate(graph.arg_nodes)}
        self._input_eids = [graph.entry_id(n) for n in graph.arg_nodes]
        self._output_eids = [graph.entry_id(nid, idx) for nid, idx, _ in graph.heads]
        self.closed = False
        self._user_inputs = frozenset(self._arg_index) - frozenset(graph.params)
        # name -> (index, shape, numpy dtype) of each user input: what a call's common case,
        # every input by name as a numpy array, is checked against (``_fast_call_inputs``)
        spec = {n: (i, tuple(graph.shapes[e]), _numpy_dtype(graph.dtypes[e]))
                for n, i in self._arg_index.items() if n in self._user_inputs
                for e in (self._input_eids[i],)}
        # (none where numpy has no dtype for an input: ``dtype != None`` is False for float64)
        self._call_spec = spec if all(d is not None for _, _, d in spec.values()) else None
        self._stateful = threading.Lock()  # set_input/run/get_output: one thread at a time

    # ---- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Free what the module holds (device memory, the server's module) now rather than when
        the last reference goes; any later call is a ``ClosedError``. Closing twice is fine."""
        if not self.closed:
            with self._stateful:  # a run, set_input or get_output in flight finishes first
                if self.closed:
                    return
                self.closed = True
                self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _claim(self, what: str):
        """The module's state (inputs, outputs, ``run``) for this thread, or an error: another
        thread's values would mix with this one's."""
        if not self._stateful.acquire(blocking=False):
            raise self._in_use(what)
        try:
            self._check_open()
            yield
        finally:
            self._stateful.release()

    def _in_use(self, what: str) -> ExecutionError:
        return ExecutionError(
            f"{what}: another thread is using this module's set_input/run/get_output; their "
            f"values would mix. Give each thread its own module (share_params keeps one copy "
            f"of the weights) or call the module: outputs = m(x=...) is thread-safe")

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"{type(self).__name__} is closed; create or load it again")

    # ---- what subclasses provide ------------------------------------------------------------
    def run(self, **inputs) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def _store(self, idx: int, value: Any) -> None:
        """Copy a checked ``value`` into input ``idx`` (the caller holds ``_claim``)."""
        raise NotImplementedError

    def _get(self, kind: str, idx: int, out):
        """The tensor of input/output ``idx`` (``kind`` "input" or "output"), or a copy of it
        in ``out`` (already checked)."""
        raise NotImplementedError

    # ---- inputs ---------------------------------------------------------------------------
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
        params = set(self.graph.params)
        names = [n for n in self._arg_index if n not in params]
        eids = [self._input_eids[self._arg_index[n]] for n in names]
        return ({n: self.graph.shapes[e] for n, e in zip(names, eids, strict=True)},
                {n: self.graph.dtypes[e] for n, e in zip(names, eids, strict=True)})

    def _resolve_input(self, key: int | str) -> int:
        if isinstance(key, str):
            idx = self._arg_index.get(key)
            if idx is None:
                raise InputError(f"input {did_you_mean(key, list(self._arg_index))}")
            return idx
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if not 0 <= key < len(self._arg_index):
                raise InputError(f"input index {key} out of range: the graph has "
                                 f"{len(self._arg_index)} inputs")
            return int(key)
        raise InputError(f"input key must be a name or an index, got {key!r}")

    def _checked_input(self, idx: int, value: Any, what: str) -> Any:
        eid = self._input_eids[idx]
        name = self.graph.nodes[self.graph.arg_nodes[idx]].name
        return checked_value(value, self.graph.shapes[eid], self.graph.dtypes[eid],
                             f"{what} {name!r}")

    def set_input(self, key: int | str | Mapping | None = None, value: Any = None,
                  **inputs) -> None:
        """Copy values into inputs: ``set_input("x", arr)``, ``set_input(0, arr)``,
        ``set_input(x=arr, y=arr2)`` or ``set_input({"x": arr})``. numpy arrays or TVM tensors;
        every key, shape and dtype is checked before anything is copied."""
        if isinstance(key, Mapping):
            inputs = {**key, **inputs}
        elif key is not None:
            if value is None:
                raise InputError(f"set_input({key!r}): no value given")
            inputs = {key: value, **inputs}
        self._check_open()
        items = self._checked_inputs(inputs)
        with self._claim("set_input"):
            for idx, val in items:
                self._store(idx, val)

    def _checked_inputs(self, inputs: Mapping) -> list[tuple[int, Any]]:
        """``(index, value)`` of every input named in ``inputs``, each key, shape and dtype
        checked (nothing is copied before all are)."""
        return [(i, self._checked_input(i, v, "input"))
                for i, v in ((self._resolve_input(k), v) for k, v in inputs.items())]

    def get_input(self, key: int | str, out=None):
        """The tensor holding input ``key`` (by name or index); copied into ``out`` if given."""
        self._check_open()
        idx = self._resolve_input(key)
        return self._get("input", idx, self._checked_out(out, self._input_eids[idx],
                                                        f"input {key!r}"))

    def _call_inputs(self, inputs: Mapping) -> list[tuple[int, Any]]:
        """Every user input given once, checked; a call has no state, so none may be missing."""
        fast = self._fast_call_inputs(inputs)
        if fast is not None:
            return fast
        items = [(self._resolve_input(k), v) for k, v in inputs.items()]
        given = {self.graph.nodes[self.graph.arg_nodes[i]].name for i, _ in items}
        for name in given & set(self.graph.params):
            raise InputError(f"call: {name!r} is a parameter; load_params sets it for every "
                             f"call")
        missing = sorted(self._user_inputs - given)
        if missing:
            raise InputError(f"call: no value for inputs {missing}")
        return [(i, self._checked_input(i, v, "input")) for i, v in items]

    def _fast_call_inputs(self, inputs: Mapping) -> list[tuple[int, Any]] | None:
        """The common call checked in one pass: each user input named once, by a numpy array
        of its shape and dtype; None for anything else, left to the checks that say what is
        wrong. (Right after a run, with the caches cold, the general checks took 38 us of a
        light squeezenet call, 2 vCPUs.)"""
        spec = self._call_spec
        if spec is None or len(inputs) != len(spec):
            return None
        items = []
        for k, v in inputs.items():
            s = spec.get(k) if isinstance(k, str) else None
            if s is None or type(v) is not np.ndarray or v.shape != s[1] or v.dtype != s[2]:
                return None
            items.append((s[0], v))
        return items

    def _call_outputs(self, out: list | None) -> list | None:
        if out is None:
            return None
        if not isinstance(out, (list, tuple)) or len(out) != len(self._output_eids):
            raise InputError(f"call: out must be a list of {len(self._output_eids)} arrays or "
                             f"tensors, one per output")
        for i, o in enumerate(out):
            if isinstance(o, np.ndarray):
                eid = self._output_eids[i]
                checked_value(o, self.graph.shapes[eid], self.graph.dtypes[eid], f"out[{i}]")
                if not o.flags.writeable:
                    raise InputError(f"call: out[{i}] is a read-only array")
            else:
                self._checked_out(o, self._output_eids[i], f"out[{i}]")
        return out

    # ---- outputs --------------------------------------------------------------------------
    def get_output(self, index: int, out=None):
        """The tensor of output ``index`` (valid until the next run); copied into ``out`` if
        given."""
        self._check_open()
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) \
                or not 0 <= index < len(self._output_eids):
            raise InputError(f"output index {index!r} out of range: the graph has "
                             f"{len(self._output_eids)} outputs")
        return self._get("output", int(index),
                         self._checked_out(out, self._output_eids[index], f"output {index}"))

    def _checked_out(self, out, eid: int, what: str):
        if out is None:
            return None
        if not isinstance(out, tvm.runtime.Tensor):
            raise InputError(f"{what}: out must be a tvm Tensor, got {type(out).__name__}")
        shape, dtype = tuple(self.graph.shapes[eid]), self.graph.dtypes[eid]
        if tuple(out.shape) != shape or str(out.dtype) != dtype:
            raise InputError(f"{what}: out is {tuple(out.shape)} {out.dtype}, expected "
                             f"{shape} {dtype}")
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.graph.nodes)} nodes, "
                f"devices={[str(d) for d in self.devices]})")

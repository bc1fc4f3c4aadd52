"""Steps bound to storage, and activation frames: what lets many threads call one module.

A frame is one call's memory: pools for everything that is not a weight, the weights shared
with the module (its weight pools), and the module's steps bound to them. Frames wait in a
free list; a call takes one, runs, and gives it back, so N concurrent calls need N frames and
one copy of the weights. A call may bind its caller's own buffers for inputs and outputs
(zero copy): the steps that read or write those entries get them for that call only.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np
import tvm
import tvm_ffi

from hgrt import devices as hdev
from hgrt import providers
from hgrt.errors import GraphError
from hgrt.graph import COPY_FUNC, Graph
from hgrt.lifetimes import ALIGN, runs, storage_bytes, storage_devices
from hgrt.runtime.pools import StoragePools
from hgrt.runtime.step_loop import StepLoop
from hgrt.runtime.threads import solo

copy_tensor = tvm.get_global_func("runtime.TVMTensorCopyFromTo")
_stream_sync = tvm.get_global_func("runtime.Device_StreamSync")


class Step(NamedTuple):
    """One call of ``run()``: node ``node`` calls ``func(*args)``; ``args[i]`` is entry
    ``eids[i]``."""

    node: int
    func: Any
    args: tuple
    eids: tuple


def kernel_function(name: str):
    """The global function ``name``, a kernel provider's (its runtime loaded first), or None."""
    provider = providers.of_func(name)
    runtime = provider.load_runtime() if provider is not None else None
    if runtime is not None and hasattr(runtime, "kernel_function"):  # a kernel made per name
        return runtime.kernel_function(name)
    if runtime is not None:
        runtime.load()
    return tvm.get_global_func(name, allow_missing=True)


def _find_function(lib, name: str):
    try:
        return lib.get_function(name, query_imports=True)
    except (AttributeError, RuntimeError):
        return kernel_function(name)  # not in the library: a kernel provider's global function


def bind_steps(graph: Graph, lib, storage: StoragePools) -> tuple[Step, ...]:
    """Every kernel and copy of ``graph`` as a step on ``storage``'s views (a ``__nop`` or
    ``__concat`` is a view, no step)."""
    steps = []
    for nid, node in enumerate(graph.nodes):
        if not runs(node):
            continue
        eids = [graph.entry_id(i, k) for i, k, _ in node.inputs]
        eids += [graph.entry_id(nid, k) for k in range(node.num_outputs)]
        if node.func_name == COPY_FUNC:
            func, flat = _copy_function(storage, eids[0], eids[1]), False
        else:
            func, flat = _find_function(lib, node.func_name), node.flatten_data
            if func is None:
                kinds = [lib.kind] + [m.kind for m in lib.imports]
                raise GraphError(f"{graph.describe_node(nid)}: function {node.func_name!r} is "
                                 f"not in the library (looked in module '{kinds[0]}'"
                                 f"{f' and its imports {kinds[1:]}' if kinds[1:] else ''})")
        steps.append(Step(nid, func, tuple(storage.kernel_view(e, flat) for e in eids),
                          tuple(eids)))
    return _solo_next_to_providers(graph, steps)


def _copy_function(storage: StoragePools, src: int, dst: int):
    """The copy from entry ``src`` to entry ``dst``: TVM's, which a GPU queues on its default
    stream (``cudaMemcpyAsync``). To or from pageable memory that copy is done when it
    returns; to or from pinned host memory (``pinned_pools``) it is not, so there the step also
    waits for the GPU: the CPU reads the bytes it brought, or writes over those it takes,
    only after."""
    if not (storage.pinned(src) or storage.pinned(dst)):
        return copy_tensor
    gpu = storage.devices[storage.graph.entry_device(dst if storage.pinned(src) else src)]

    def copy_and_wait(a, b):
        copy_tensor(a, b)
        _stream_sync(gpu, 0)

    return tvm_ffi.convert(copy_and_wait)


# Up to this many bytes of output, an injective kernel gains less from more threads than it
# loses waiting for a core (measured on 2 vCPUs only: shufflenet's shuffles, 0.4-1.5 MB,
# when they were TVM kernels; densenet121's batch norms, 0.1-3.2 MB)
SOLO_MAX_BYTES = 4 << 20


def _solo_next_to_providers(graph: Graph, steps: list[Step]) -> tuple[Step, ...]:
    """In a graph with kernels of a provider whose threads spin between kernels
    (``solo_neighbours``: oneDNN's OpenMP threads), the small injective TVM kernels on CPU
    devices run on their caller's thread alone (``threads.solo``), on every CPU device: all of
    the process's CPU devices share the cores those threads spin on."""
    nodes = graph.nodes
    spinning = [p for p in providers.registered() if p.solo_neighbours]
    if not any(p.owns(nodes[s.node].func_name) for s in steps for p in spinning):
        return tuple(steps)

    def on_cpu(step: Step) -> bool:
        return hdev.is_local_cpu(step.args[-1])

    def small(step: Step) -> bool:
        node = nodes[step.node]
        return sum(graph.entry_bytes(graph.entry_id(step.node, k))
                   for k in range(node.num_outputs)) <= SOLO_MAX_BYTES

    return tuple(s._replace(func=solo(s.func))
                 if nodes[s.node].injective and on_cpu(s) and small(s) else s for s in steps)


class Frame:
    """One call's activations and the steps bound to them."""

    def __init__(self, graph: Graph, lib, devices: list, weights: StoragePools):
        self.storage = StoragePools(graph, devices, weights=weights)
        self.steps = bind_steps(graph, lib, self.storage)
        self.loop = StepLoop(tuple((s.func, s.args) for s in self.steps))

    @staticmethod
    def bytes(graph: Graph, n_devices: int) -> list[int]:
        """What one frame allocates per device: the activation pools (the weights are shared;
        a graph planned without weight pools, or without pools, allocates all but params)."""
        if graph.pool_bytes is not None:
            return [int(b) for b in graph.pool_bytes[:n_devices]]
        out = [0] * n_devices
        owner = storage_devices(graph, GraphError)
        for sid, nbytes in storage_bytes(graph).items():
            if sid not in graph.weight_storages:
                out[owner[sid]] += max(ALIGN, nbytes)
        return out

    def overrides(self, bound: dict[int, Any], uses: dict[int, list]) -> tuple:
        """``(step, pos, tensor)`` putting ``bound[e]`` wherever a step uses entry ``e`` (viewed
        in the shape the step binds, flattened or not)."""
        out = []
        for eid, tensor in bound.items():
            for si, pos in uses.get(eid, ()):  # an input no step reads
                view = self.steps[si].args[pos]
                arg = tensor if tuple(tensor.shape) == tuple(view.shape) else \
                    tensor._create_view(tuple(view.shape), str(view.dtype), 0)
                out.append((si, pos, arg))
        return tuple(out)


def zero_copy_view(value: Any, device, shape, dtype: str, align: int = ALIGN):
    """``value`` itself as a kernel argument, when it is C-contiguous, of this shape and dtype,
    on exactly ``device`` and aligned to ``align`` bytes (what TVM kernels assume, unless only
    kernels that take any alignment touch the entry: ``loose_entries``); else None (copy
    instead)."""
    if isinstance(value, np.ndarray):
        if (value.dtype != dtype or value.shape != tuple(shape)
                or not value.flags.c_contiguous or not hdev.is_numpy_device(device)):
            return None
        try:
            view = tvm_ffi.from_dlpack(value)  # (a fraction of reading ``value.ctypes.data``)
        except Exception:
            return None
        return None if view.data_ptr() % align else view
    if isinstance(value, tvm.runtime.Tensor) and value.device == device \
            and tuple(value.shape) == tuple(shape) and str(value.dtype) == dtype \
            and value.data_ptr() % align == 0:
        return value
    return None


def loose_entries(graph: Graph, steps: tuple[Step, ...]) -> frozenset[int]:
    """Entries that only kernels of providers declared ``any_alignment`` read or write (oneDNN's
    load unaligned): a caller's buffer bound there need not start at a multiple of ``ALIGN``
    bytes (TVM's kernels may assume the alignment the plan gives and fault without it). numpy's
    own arrays often start at 16 bytes: such an input is read where the caller left it instead
    of being copied first."""
    loose: dict[int, bool] = {}
    for s in steps:
        provider = providers.of_func(graph.nodes[s.node].func_name)
        ours = provider is not None and provider.any_alignment
        for e in s.eids:
            loose[e] = loose.get(e, True) and ours
    return frozenset(e for e, ok in loose.items() if ok)


class FramePool:
    """Frames made on demand, up to ``limit``; a caller beyond waits for one to come back.
    (A list under a lock: taking and giving back a frame is two lock round trips, where a
    ``queue.LifoQueue`` cost a few microseconds of Python each way.)"""

    def __init__(self, make, limit: int):
        self._make, self.limit = make, limit
        self._free: list[Frame] = []
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0
        self.made = 0

    def take(self, blocking: bool = True) -> Frame | None:
        """A free frame, a new one while fewer than ``limit`` exist, else one given back by
        another caller (None at once, not blocking). A frame is made outside the lock: giving
        one back never waits for another caller's allocation."""
        with self._cond:
            while not self._free and self.made >= self.limit:
                if not blocking:
                    return None
                self._waiting += 1
                try:
                    self._cond.wait()
                except BaseException:  # leaving (Ctrl-C): pass on a wake-up meant for it
                    if self._free or self.made < self.limit:
                        self._cond.notify()
                    raise
                finally:
                    self._waiting -= 1
            if self._free:
                return self._free.pop()
            self.made += 1
        try:
            return self._make()
        except BaseException:
            with self._cond:
                self.made -= 1
                self._cond.notify()  # a waiter may make the frame this caller could not
            raise

    def give(self, frame: Frame) -> None:
        with self._cond:
            self._free.append(frame)
            if self._waiting:
                self._cond.notify()

"""Device storage: one arena per device (hgrt plan) or one allocation per storage id (classic).

Every graph entry is a (base buffer, byte offset) pair; kernel views and user views of it are
made once, at ``create`` time, and cached.
"""

from __future__ import annotations

import logging
import os
import weakref

import tvm

from hgrt import devices as hdev
from hgrt.errors import DeviceError, GraphError
from hgrt.graph import COPY_FUNC, Graph
from hgrt.lifetimes import ALIGN, storage_bytes, storage_devices
from hgrt.providers import forget_memory
from hgrt.runtime.views import pointer_view


def _allocate(nbytes: int, device, what: str):
    try:
        return tvm.runtime.empty((max(1, nbytes),), "uint8", device)
    except Exception as e:  # TVM raises several types for out-of-memory / bad devices
        raise DeviceError(f"cannot allocate {nbytes} bytes for {what} on {device}: {e}") from e


def pinned_pools(graph: Graph, devices: list) -> frozenset[int]:
    """Positions of the local CPUs whose activation pool is allocated in pinned (page-locked)
    host memory, which a CUDA GPU reads and writes by DMA, without the driver's staging through
    a bounce buffer: the CPUs that copies reach to or from a local CUDA GPU, unless a copy from
    that CPU to a GPU would wait for GPU work it does not need. (A copy to or from pinned
    memory waits for the GPU's queue, see ``frames``: from pageable memory a copy to a GPU
    returns once staged. After ``overlap_order`` a CPU op that reads nothing of the GPU's runs
    while the GPU's earlier kernels do; a copy of its result to the GPU then waits for them in
    pinned memory and not in pageable.) Empty with ``HGRT_PIN_HOST=0``."""
    if os.environ.get("HGRT_PIN_HOST", "1") == "0":
        return frozenset()

    def on_gpu(d: int) -> bool:
        return d < len(devices) and hdev.is_local_cuda(devices[d])

    out, waits = set(), set()
    ancestors: list[int] = []  # per node, its ancestors as bits
    gpu_work = 0  # the GPU kernels and copies to a GPU so far, in step order, as bits
    for nid, node in enumerate(graph.nodes):
        above = 0
        for i, _, _ in node.inputs:
            above |= ancestors[i] | (1 << i)
        ancestors.append(above)
        if node.op != "tvm_op":
            continue
        here = graph.entry_device(graph.entry_id(nid))
        if node.func_name == COPY_FUNC:
            src = graph.entry_device(graph.entry_id(*node.inputs[0][:2]))
            ends = [d for d in (src, here) if d < len(devices)]
            if any(on_gpu(d) for d in ends):
                out.update(d for d in ends if hdev.is_local_cpu(devices[d]))
            if on_gpu(here) and not on_gpu(src) and gpu_work & ~above:
                waits.add(src)
        if on_gpu(here):
            gpu_work |= 1 << nid
    return frozenset(out - waits)


def _allocate_pinned(nbytes: int, device, what: str):
    """Pinned host memory for a CPU pool (``pinned_pools``), or None where the CUDA runtime
    cannot give it (the pool is then allocated as any CPU's, and said once)."""
    try:
        return tvm.runtime.empty((max(1, nbytes),), "uint8", hdev.pinned_host_device())
    except Exception as e:  # TVM raises several types for out-of-memory / a missing runtime
        if not _said_unpinned:
            _said_unpinned.append(True)
            _log.info("%s on %s in pageable memory: pinned host memory unavailable (%s)",
                      what, device, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


_said_unpinned: list[bool] = []
_log = logging.getLogger("hgrt.runtime")


class StoragePools:
    """The memory a GraphModule (or one call frame of it) owns, and where each graph entry lives.

    With ``weights`` (the pools of the module a frame belongs to), parameter entries are not
    allocated again: they point at ``weights``' weight pools (or parameter storages)."""

    def __init__(self, graph: Graph, devices: list, weights: StoragePools | None = None):
        self.graph = graph
        self.devices = list(devices)
        self.device_bytes = [0] * len(devices)  # bytes allocated here per device position
        self.buffers: list = [] if weights is None else [weights]  # keeps shared weights alive
        if graph.pool_bytes is not None:
            self._allocate_arenas(devices, weights)
        else:
            self._allocate_storages(devices, weights)
        # a __nop output views its input, a __concat's pieces lie in its output
        within = graph.entry_offsets()
        for eid, root in enumerate(graph.alias_roots()):
            self.base[eid], self.offset[eid] = self.base[root], self.offset[root] + within[eid]
        self._kernel_views: dict[tuple[int, bool], object] = {}
        self._user_views: dict[int, object] = {}
        if weights is None:  # a module's own pools (a frame's hold no weights): what kernel
            # libraries cache per weight address goes with the memory
            weakref.finalize(self, forget_memory, [
                (b.data_ptr(), b.data_ptr() + b.numel() * b.dtype.itemsize)
                for b in self.buffers if hdev.is_local_cpu(b)])

    def _allocate_arenas(self, devices: list, weights: StoragePools | None) -> None:
        """hgrt plan: per device an activation arena and a weight arena (when the plan has
        one); entries at their storage's byte offset."""
        g = self.graph
        arenas = {}
        pinned = pinned_pools(g, devices)
        for d, nbytes in enumerate(g.pool_bytes[:len(devices)]):
            what = f"the pool of device {d}"
            arena = _allocate_pinned(nbytes, devices[d], what) if d in pinned else None
            arenas[d, False] = arena if arena is not None else \
                _allocate(nbytes, devices[d], what)
            self.device_bytes[d] += int(nbytes)
        for d, nbytes in enumerate((g.weight_pool_bytes or [])[:len(devices)]):
            if weights is None:
                arenas[d, True] = _allocate(nbytes, devices[d], f"the weight pool of device {d}")
                self.device_bytes[d] += int(nbytes)
        self.buffers += list(arenas.values())
        pools = [g.pool_of(e) for e in range(g.num_entries)]
        # a frame reads the module's parameters, in its weight pool or (a plan without weight
        # pools) in its activation pool: the frame's own copy of those bytes is never loaded
        shared = [weights is not None and g.storage_ids[e] in g.weight_storages
                  for e in range(g.num_entries)]
        self.base = [weights.base[e] if shared[e] else arenas[p] for e, p in enumerate(pools)]
        self.offset = [weights.offset[e] if shared[e] else g.storage_offset[g.storage_ids[e]]
                       for e in range(g.num_entries)]

    def _allocate_storages(self, devices: list, weights: StoragePools | None) -> None:
        """Classic layout: each storage id sized by the largest entry that uses it."""
        g = self.graph
        owner = storage_devices(g, GraphError)
        shared = g.weight_storages if weights is not None else frozenset()
        storage = {}
        for sid, nbytes in sorted(storage_bytes(g).items()):
            if sid not in shared:
                nbytes = max(ALIGN, nbytes)
                storage[sid] = _allocate(nbytes, devices[owner[sid]], f"storage {sid}")
                self.device_bytes[owner[sid]] += nbytes
        self.buffers += list(storage.values())
        self.base = [weights.base[e] if sid in shared else storage[sid]
                     for e, sid in enumerate(g.storage_ids)]
        self.offset = [weights.offset[e] if sid in shared else 0
                       for e, sid in enumerate(g.storage_ids)]

    def adopt(self, dst: int, other: StoragePools, src: int) -> None:
        """Entry ``dst`` uses entry ``src`` of another module's pools (``share_params``), and
        so do the views of it (``__nop`` outputs whose bytes are ``dst``'s)."""
        roots, within = self.graph.alias_roots(), self.graph.entry_offsets()
        moved = {e for e, r in enumerate(roots) if r == dst} | {dst}
        for e in moved:
            self.base[e], self.offset[e] = other.base[src], other.offset[src] + within[e]
        self.buffers.append(other)  # keep the other module's memory alive as long as ours
        self._kernel_views = {k: v for k, v in self._kernel_views.items() if k[0] not in moved}
        for e in moved:
            self._user_views.pop(e, None)

    def pinned(self, eid: int) -> bool:
        """Whether entry ``eid`` lies in pinned host memory (``pinned_pools``)."""
        return hdev.is_pinned_host(self.base[eid])

    def _shown_as(self, eid: int):
        """The device views of entry ``eid`` say they are on where not their buffer's: the CPU
        whose pool lies in pinned CUDA host memory (CPU kernels take CPU tensors only)."""
        return self.devices[self.graph.entry_device(eid)] if self.pinned(eid) else None

    def kernel_view(self, eid: int, flat: bool = False):
        """The tensor passed to kernels for entry ``eid`` (1-D when ``flat``)."""
        key = (eid, flat)
        view = self._kernel_views.get(key)
        if view is None:
            shape = self.graph.shapes[eid]
            if flat:
                n = 1
                for s in shape:
                    n *= s
                shape = (n,)
            view = pointer_view(self.base[eid], shape, self.graph.dtypes[eid], self.offset[eid],
                                own_base=False, device=self._shown_as(eid))
            self._kernel_views[key] = view
        return view

    def user_view(self, eid: int):
        """An owning tensor for entry ``eid``, safe to hand out (it keeps its buffer alive)."""
        view = self._user_views.get(eid)
        if view is None:
            if self.offset[eid] == 0:
                view = self.kernel_view(eid)
            elif self.pinned(eid):
                view = pointer_view(self.base[eid], self.graph.shapes[eid], self.graph.dtypes[eid],
                                    self.offset[eid], device=self._shown_as(eid))
            else:
                view = self.base[eid]._create_view(self.graph.shapes[eid], self.graph.dtypes[eid],
                                                   self.offset[eid])
            self._user_views[eid] = view
        return view

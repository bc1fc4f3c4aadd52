"""Device storage: one arena per device (hgrt plan) or one allocation per storage id (classic).

Every graph entry is a (base buffer, byte offset) pair; kernel views and user views of it are
made once, at ``create`` time, and cached.
"""

from __future__ import annotations

import tvm

from hgrt.errors import DeviceError
from hgrt.graph import Graph
from hgrt.runtime.views import pointer_view

_ALIGN = 64


def _allocate(nbytes: int, device, what: str):
    try:
        return tvm.runtime.empty((max(1, nbytes),), "uint8", device)
    except Exception as e:  # TVM raises several types for out-of-memory / bad devices
        raise DeviceError(f"cannot allocate {nbytes} bytes for {what} on {device}: {e}") from e


class StoragePools:
    """The memory a GraphModule owns, and where each graph entry lives in it."""

    def __init__(self, graph: Graph, devices: list):
        self.graph = graph
        self.device_bytes = [0] * len(devices)  # bytes allocated per device position
        self.buffers: list = []
        self._keep: list = []  # DLPack structs behind the kernel views
        if graph.pool_bytes is not None:
            # hgrt plan: one arena per device, entries at their storage's byte offset.
            for d, nbytes in enumerate(graph.pool_bytes[:len(devices)]):
                self.buffers.append(_allocate(nbytes, devices[d], f"the pool of device {d}"))
                self.device_bytes[d] = int(nbytes)
            self.base = [self.buffers[graph.entry_device(e)] for e in range(graph.num_entries)]
            self.offset = [graph.storage_offset[sid] for sid in graph.storage_ids]
        else:
            # Classic layout: each storage id sized by the largest entry that uses it.
            size: dict[int, int] = {}
            dev_of: dict[int, int] = {}
            for eid, sid in enumerate(graph.storage_ids):
                size[sid] = max(size.get(sid, 0), graph.entry_bytes(eid))
                dev_of[sid] = graph.entry_device(eid)
            storage = {}
            for sid in sorted(size):
                nbytes = (max(1, size[sid]) + _ALIGN - 1) // _ALIGN * _ALIGN
                storage[sid] = _allocate(nbytes, devices[dev_of[sid]], f"storage {sid}")
                self.device_bytes[dev_of[sid]] += nbytes
            self.buffers = list(storage.values())
            self.base = [storage[sid] for sid in graph.storage_ids]
            self.offset = [0] * graph.num_entries
        self._kernel_views: dict[tuple[int, bool], object] = {}
        self._user_views: dict[int, object] = {}

    def alias(self, dst: int, src: int) -> None:
        """Entry ``dst`` shares ``src``'s bytes (``__nop``)."""
        self.base[dst], self.offset[dst] = self.base[src], self.offset[src]

    def adopt(self, dst: int, other: StoragePools, src: int) -> None:
        """Entry ``dst`` uses entry ``src`` of another module's pools (``share_params``)."""
        self.base[dst], self.offset[dst] = other.base[src], other.offset[src]
        self.buffers.append(other)  # keep the other module's memory alive as long as ours
        self._kernel_views = {k: v for k, v in self._kernel_views.items() if k[0] != dst}
        self._user_views.pop(dst, None)

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
                                self._keep)
            self._kernel_views[key] = view
        return view

    def user_view(self, eid: int):
        """An owning tensor for entry ``eid``, safe to hand out (it keeps its buffer alive)."""
        view = self._user_views.get(eid)
        if view is None:
            if self.offset[eid] == 0:
                view = self.kernel_view(eid)
            else:
                view = self.base[eid]._create_view(self.graph.shapes[eid], self.graph.dtypes[eid],
                                                   self.offset[eid])
            self._user_views[eid] = view
        return view

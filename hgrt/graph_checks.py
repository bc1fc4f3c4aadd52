"""What a graph read from JSON must keep beyond each field's form (``Graph.from_json`` runs
these; every defect a ``GraphError`` naming its place): edges that name earlier nodes' outputs,
the special functions (``__copy`` moves a tensor to another device unchanged, ``__nop`` views
its input's bytes, ``__slice`` a range of them, ``__concat`` lays its pieces one after
another), the ``hgrt`` section (its version, params, devices, CPU needs, pools and storage
offsets, streams and waits: a wait for every read across streams), weight storages that hold
their weight only, and entries within their pools.

Functions take an ``hgrt.graph.Graph`` (not imported here: graph.py checks with this module), as
``hgrt.lifetimes``' do.
"""

from __future__ import annotations

from typing import Any

from hgrt import lifetimes
from hgrt.errors import GraphError
from hgrt.graph_format import (
    CONCAT_FUNC,
    COPY_FUNC,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    NOP_FUNC,
    SLICE_FUNC,
)

# the 'hgrt' section's format: 3 where a graph has __slice views, 2 where it has __concat views
# (an older hgrt, which would look for a kernel of that name, refuses the version instead); 1
# else, as before
Graph = Any  # an hgrt.graph.Graph
Node = Any  # an hgrt.graph.Node


def check_edges(nodes: list[Node], row_ptr: list[int]) -> None:
    """node_row_ptr fits the nodes' outputs; inputs name earlier nodes' existing outputs."""
    n_nodes = len(nodes)
    if len(row_ptr) != n_nodes + 1:
        raise GraphError(f"node_row_ptr has {len(row_ptr)} values, expected {n_nodes + 1} "
                         f"(number of nodes + 1)")
    if row_ptr[0] != 0:
        raise GraphError(f"node_row_ptr[0] must be 0, got {row_ptr[0]}")
    for nid, node in enumerate(nodes):
        where = f"node {nid} '{node.name}'"
        if row_ptr[nid + 1] - row_ptr[nid] != node.num_outputs:
            raise GraphError(f"{where}: node_row_ptr gives it {row_ptr[nid + 1] - row_ptr[nid]}"
                             f" outputs but it declares {node.num_outputs}")
        for nid_in, idx, _ in node.inputs:
            if not 0 <= nid_in < n_nodes:
                raise GraphError(f"{where}: input refers to node {nid_in}, which does not exist "
                                 f"({n_nodes} nodes)")
            if nid_in >= nid:
                raise GraphError(f"{where}: input refers to node {nid_in}, which comes later "
                                 f"(nodes must be topologically sorted)")
            if not 0 <= idx < nodes[nid_in].num_outputs:
                raise GraphError(f"{where}: input refers to output {idx} of node {nid_in} "
                                 f"'{nodes[nid_in].name}', which has {nodes[nid_in].num_outputs}")


def check_special_ops(g: Graph) -> None:
    """``__copy`` moves one tensor to another device unchanged; ``__nop`` views its input's
    bytes on the same device; ``__slice`` a range of them; ``__concat`` is its pieces laid one
    after another."""
    for nid, node in enumerate(g.nodes):
        if node.func_name == CONCAT_FUNC:
            _check_concat(g, nid)
            continue
        if node.func_name == SLICE_FUNC:
            _check_slice(g, nid)
            continue
        if node.func_name not in (COPY_FUNC, NOP_FUNC):
            continue
        what = g.describe_node(nid)
        if len(node.inputs) != 1 or node.num_outputs != 1:
            raise GraphError(f"{what}: {node.func_name} takes one input, one output")
        src, dst = g.entry_id(node.inputs[0][0], node.inputs[0][1]), g.entry_id(nid)
        if node.func_name == COPY_FUNC and (g.shapes[src], g.dtypes[src]) != (g.shapes[dst],
                                                                              g.dtypes[dst]):
            raise GraphError(f"{what}: __copy from {g.shapes[src]} {g.dtypes[src]} to "
                             f"{g.shapes[dst]} {g.dtypes[dst]}: shape and dtype must match")
        if node.func_name == NOP_FUNC and g.entry_device(src) != g.entry_device(dst):
            raise GraphError(f"{what}: __nop cannot cross devices ({g.entry_device(src)} -> "
                             f"{g.entry_device(dst)}); use __copy")
        if node.func_name == NOP_FUNC and g.entry_bytes(src) != g.entry_bytes(dst):
            raise GraphError(f"{what}: __nop changes the byte size ({g.entry_bytes(src)} -> "
                             f"{g.entry_bytes(dst)})")
    g.entry_offsets()  # a tensor that is a view twice, or of itself: a GraphError


def _check_slice(g: Graph, nid: int) -> None:
    """A ``__slice``: one input and one output on one device, ``byte_offset`` a multiple of
    ``ALIGN`` (kernels may assume aligned data), the output's bytes within the input's."""
    node, what = g.nodes[nid], g.describe_node(nid)
    if len(node.inputs) != 1 or node.num_outputs != 1:
        raise GraphError(f"{what}: __slice takes one input, one output")
    if "byte_offset" not in node.attrs:
        raise GraphError(f"{what}: __slice without attrs.byte_offset")
    src, dst = g.entry_id(*node.inputs[0][:2]), g.entry_id(nid)
    at, size, whole = node.byte_offset, g.entry_bytes(dst), g.entry_bytes(src)
    if g.entry_device(src) != g.entry_device(dst):
        raise GraphError(f"{what}: __slice cannot cross devices ({g.entry_device(src)} -> "
                         f"{g.entry_device(dst)}); use __copy")
    if at % lifetimes.ALIGN:
        raise GraphError(f"{what}: byte_offset {at} is not a multiple of {lifetimes.ALIGN}")
    if at + size > whole:
        raise GraphError(f"{what}: bytes {at}..{at + size} lie outside its input "
                         f"{g.describe_entry(src)}")


def concat_axis(shapes: list[tuple[int, ...]], out: tuple[int, ...]) -> int | None:
    """The axis along which ``shapes`` laid one after another in memory make ``out`` (every
    dimension before it 1, the others equal, the axis' sizes summing to out's), else None."""
    if not shapes or not out or any(len(s) != len(out) for s in shapes):
        return None
    differ = {a for s in shapes for a, (d, o) in enumerate(zip(s, out, strict=True)) if d != o}
    if len(differ) > 1:
        return None
    axis = differ.pop() if differ else 0
    if sum(s[axis] for s in shapes) != out[axis] or any(d != 1 for d in out[:axis]):
        return None
    return axis


def concat_problem(g: Graph, nid: int, storage: bool = True) -> str | None:
    """Why node ``nid``'s inputs cannot be pieces written in place in its output's bytes
    (``__concat``), or None: shapes that do not lay one after another into the output, a piece
    twice, a piece no step writes there (an input, a weight, a view), another dtype or device,
    a piece not at a multiple of ``ALIGN`` bytes; with ``storage``, another storage id."""
    node = g.nodes[nid]
    out = g.entry_id(nid)
    pieces = [g.entry_id(src, idx) for src, idx, _ in node.inputs]
    if node.num_outputs != 1 or not pieces:
        return "a __concat takes its pieces and gives one output"
    if concat_axis([g.shapes[p] for p in pieces], g.shapes[out]) is None:
        return (f"pieces {[g.shapes[p] for p in pieces]} laid one after another do not make "
                f"{g.shapes[out]} (one axis may differ, every dimension before it 1)")
    if len(set(pieces)) != len(pieces):
        return "a piece appears twice"
    at = 0
    for p in pieces:
        source = g.nodes[g.node_of_entry(p)]
        why = ("is an input, a weight or a view: no step writes it in place"
               if not (lifetimes.runs(source) or source.func_name == CONCAT_FUNC)
               else "has another dtype" if g.dtypes[p] != g.dtypes[out]
               else "is on another device" if g.entry_device(p) != g.entry_device(out)
               else "has another storage id" if storage and g.storage_ids[p] != g.storage_ids[out]
               else f"would start at byte {at}, not a multiple of {lifetimes.ALIGN}"
               if at % lifetimes.ALIGN else None)
        if why is not None:
            return f"piece {g.describe_entry(p)} {why}"
        at += g.entry_bytes(p)
    return None


def _check_concat(g: Graph, nid: int) -> None:
    problem = concat_problem(g, nid)
    if problem is not None:
        raise GraphError(f"{g.describe_node(nid)}: {problem}")


def read_section(section: Any, g: Graph) -> None:
    if section is None:
        return
    if not isinstance(section, dict):
        raise GraphError("'hgrt' section must be an object")
    version = section.get("version", FORMAT_VERSION)
    if version not in FORMAT_VERSIONS or isinstance(version, bool):
        raise GraphError(f"'hgrt' section: format version {version!r} is not supported "
                         f"(this hgrt reads versions {list(FORMAT_VERSIONS)})")
    if version < 3 and any(n.func_name == SLICE_FUNC for n in g.nodes):
        raise GraphError(f"'hgrt' section: format version {version} has no {SLICE_FUNC} "
                         f"nodes (version 3 does)")
    params = section.get("params", [])
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise GraphError("'hgrt' section: params must be a list of input names")
    arg_names = {g.nodes[a].name for a in g.arg_nodes}
    for p in params:
        if p not in arg_names:
            raise GraphError(f"'hgrt' section: param {p!r} is not an input node")
    g.params = params
    _parse_streams(section, g)
    names = section.get("devices")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise GraphError("'hgrt' section: devices must be a list of device names")
        g.device_names = names
    used = max(g.device_index, default=0) + 1 if g.device_index is not None else 1
    if names is not None and len(names) < used:
        raise GraphError(f"'hgrt' section: devices names {len(names)} devices ({names}), but "
                         f"device_index uses {used}")
    g.cpu_needs = _parse_cpu_needs(section.get("cpu_needs"), used)
    if "pool_bytes" not in section:
        return
    pools = section["pool_bytes"]
    offsets = section.get("storage_offset")
    weights = section.get("weight_pool_bytes")
    for key, val in (("pool_bytes", pools), ("weight_pool_bytes", weights)):
        if val is not None and (not isinstance(val, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in val)):
            raise GraphError(f"'hgrt' section: {key} must be a list of byte counts, one per "
                             f"device")
    n_storage = max(g.storage_ids, default=-1) + 1
    if not isinstance(offsets, list) or len(offsets) != n_storage:
        raise GraphError(f"'hgrt' section: storage_offset must list one byte offset per storage "
                         f"id ({n_storage}), got {str(offsets)[:80]}")
    for sid, off in enumerate(offsets):
        if isinstance(off, bool) or not isinstance(off, int) or off < 0:
            raise GraphError(f"'hgrt' section: storage_offset[{sid}] = {off!r} is not a byte "
                             f"offset")
        if off % lifetimes.ALIGN:  # kernels assume aligned data: a misaligned one may crash
            raise GraphError(f"'hgrt' section: storage_offset[{sid}] = {off} is not a multiple "
                             f"of {lifetimes.ALIGN} bytes (every storage starts aligned)")
    g.pool_bytes = pools
    g.storage_offset = offsets
    g.weight_pool_bytes = weights


def _parse_cpu_needs(needs: Any, used: int) -> list[dict | None] | None:
    if needs is None:
        return None
    if not isinstance(needs, list) or len(needs) < used:
        raise GraphError(f"'hgrt' section: cpu_needs must list, per device ({used}), what its "
                         f"kernels need of a CPU (or null), got {str(needs)[:80]}")
    for i, need in enumerate(needs):
        if need is not None and not (
                isinstance(need, dict) and isinstance(need.get("arch"), str)
                and isinstance(need.get("features"), list)
                and all(isinstance(f, str) for f in need["features"])):
            raise GraphError(f"'hgrt' section: cpu_needs[{i}] must be null or "
                             f'{{"arch": str, "features": [str, ...]}}, got {str(need)[:80]}')
    return needs


def _parse_streams(section: dict, g: Graph) -> None:
    streams, waits = section.get("streams"), section.get("waits")
    if streams is None and waits is None:
        return
    n = len(g.nodes)
    if not isinstance(streams, list) or len(streams) != n or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in streams):
        raise GraphError(f"'hgrt' section: streams must list one stream id (or -1) per node "
                         f"({n}), got {str(streams)[:80]}")
    if not isinstance(waits, list) or len(waits) != n or not all(
            isinstance(w, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                        for x in w) for w in waits):
        raise GraphError(f"'hgrt' section: waits must list, per node, the node ids it waits for "
                         f"({n} lists)")
    g.streams, g.waits = streams, waits


def check_streams(g: Graph) -> None:
    """Every node that runs has a stream, a stream stays on one device, a wait names an earlier
    node of another stream, and every node's inputs are done before it starts."""
    if g.streams is None:
        return
    device: dict[int, int] = {}
    for nid, node in enumerate(g.nodes):
        s, where = g.streams[nid], g.describe_node(nid)
        if lifetimes.runs(node) != (s >= 0):
            raise GraphError(f"{where}: stream {s}, but " + (
                "it runs: give it a stream" if s < 0 else "it does not run: give it -1"))
        if s >= 0 and device.setdefault(s, g.entry_device(g.entry_id(nid))) != \
                g.entry_device(g.entry_id(nid)):
            raise GraphError(f"{where}: stream {s} runs on device {device[s]}, this node on "
                             f"device {g.entry_device(g.entry_id(nid))}")
        for w in g.waits[nid]:
            if not 0 <= w < nid or g.streams[w] < 0 or g.streams[w] == s:
                raise GraphError(f"{where}: waits for node {w}, which is not an earlier node "
                                 f"of another stream")
    used = sorted(set(g.streams) - {-1})
    if used != list(range(len(used))):
        missing = sorted(set(range(used[-1] + 1)) - set(used))
        raise GraphError(f"'hgrt' section: stream ids must be 0..{len(used) - 1}, got {used} "
                         f"(no node on stream {missing[0]})")
    order = lifetimes.Order(g)
    writers = lifetimes.entry_writers(g)
    for nid, node in enumerate(g.nodes):
        if g.streams[nid] < 0:
            continue
        for src, idx, _ in node.inputs:
            for writer in writers[g.entry_id(src, idx)]:
                if order.before(writer, nid):
                    continue
                raise GraphError(f"{g.describe_node(nid)} (stream {g.streams[nid]}) reads the "
                                 f"output of {g.describe_node(writer)} (stream "
                                 f"{g.streams[writer]}) with no event between them: a race")


def check_weight_storages(g: Graph) -> None:
    """A parameter's storage holds that parameter (and views of it) only: call frames and other
    modules share weight storages, so an activation there would be shared by every call."""
    roots = g.alias_roots()
    owner: dict[int, int] = {}
    params = set(g.params)
    for n in g.arg_nodes:
        if g.nodes[n].name in params:
            eid = g.entry_id(n)
            first = owner.setdefault(g.storage_ids[eid], eid)
            if first != eid:
                raise GraphError(f"parameters {g.describe_entry(first)} and "
                                 f"{g.describe_entry(eid)} share storage {g.storage_ids[eid]}")
    for eid, sid in enumerate(g.storage_ids):
        if sid in owner and roots[eid] != owner[sid]:
            raise GraphError(f"{g.describe_entry(eid)} uses storage {sid} of parameter "
                             f"{g.describe_entry(owner[sid])}: a weight's storage holds only it")


def check_pools(g: Graph) -> None:
    """With a pool plan, every entry fits in the pool of its device (its weight pool, for a
    parameter when the plan has weight pools)."""
    if g.pool_bytes is None:
        return
    offsets = g.entry_offsets()
    for eid, sid in enumerate(g.storage_ids):
        dev, weight = g.pool_of(eid)
        pools = g.weight_pool_bytes if weight else g.pool_bytes
        what = "weight pool" if weight else "pool"
        if dev >= len(pools):
            raise GraphError(f"entry {eid} is on device {dev} but the 'hgrt' section plans "
                             f"{what}s for {len(pools)} devices")
        end = g.storage_offset[sid] + offsets[eid] + g.entry_bytes(eid)
        if end > pools[dev]:
            raise GraphError(f"entry {eid} (storage {sid}) ends at byte {end}, past the "
                             f"{pools[dev]}-byte {what} of device {dev}")

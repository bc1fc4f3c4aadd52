"""The hgrt graph: TVM's classic graph-executor JSON, plus a ``device_index`` column and an
optional ``hgrt`` section with the device-aware memory plan.

Layout (see DESIGN.md, "The graph JSON")::

    {"nodes": [{"op": "null", "name": "x", "inputs": []},
               {"op": "tvm_op", "name": "add", "inputs": [[0, 0, 0]],
                "attrs": {"func_name": "add", "num_inputs": "1", "num_outputs": "1",
                          "flatten_data": "0"}}],
     "arg_nodes": [0], "node_row_ptr": [0, 1, 2], "heads": [[1, 0, 0]],
     "attrs": {"shape": ["list_shape", [[4], [4]]], "dltype": ["list_str", ["float32", "float32"]],
               "storage_id": ["list_int", [0, 1]], "device_index": ["list_int", [0, 1]]},
     "hgrt": {"version": 1, "pool_bytes": [16, 16], "storage_offset": [0, 0],
              "params": []}}

``device_index`` is a position in the device list given to ``hgrt.create``; entry ids are
``node_row_ptr[nid] + output_index`` and index every ``attrs`` column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hgrt.errors import GraphError

FORMAT_VERSION = 1
COPY_FUNC = "__copy"
NOP_FUNC = "__nop"
_KNOWN_OPS = ("null", "tvm_op")


@dataclass
class Node:
    """One graph node: an input/param (``op == "null"``) or a kernel call (``op == "tvm_op"``)."""

    op: str
    name: str
    inputs: list[tuple[int, int, int]] = field(default_factory=list)
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def func_name(self) -> str | None:
        return self.attrs.get("func_name") if self.op == "tvm_op" else None

    @property
    def num_outputs(self) -> int:
        return int(self.attrs.get("num_outputs", "1")) if self.op == "tvm_op" else 1

    @property
    def flatten_data(self) -> bool:
        return self.attrs.get("flatten_data", "0") not in ("0", "", "false", "False")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op, "name": self.name,
                               "inputs": [list(i) for i in self.inputs]}
        if self.attrs:
            out["attrs"] = dict(self.attrs)
        return out


@dataclass
class Graph:
    """A validated graph. Columns are indexed by entry id."""

    nodes: list[Node]
    arg_nodes: list[int]
    node_row_ptr: list[int]
    heads: list[tuple[int, int, int]]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    storage_ids: list[int]
    device_index: list[int] | None = None
    extra_columns: dict[str, list] = field(default_factory=dict)
    pool_bytes: list[int] | None = None  # hgrt section: one arena per device
    storage_offset: list[int] | None = None  # hgrt section: byte offset of each storage id
    params: list[str] = field(default_factory=list)  # names of arg nodes that are parameters
    device_names: list[str] | None = None  # hgrt section: what the compiler built each index for

    # ---- derived views ------------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return self.node_row_ptr[-1]

    def entry_id(self, nid: int, index: int = 0) -> int:
        return self.node_row_ptr[nid] + index

    def entry_device(self, eid: int) -> int:
        return self.device_index[eid] if self.device_index is not None else 0

    def entry_bytes(self, eid: int) -> int:
        return int(np.prod(self.shapes[eid], dtype=np.int64)) * dtype_bytes(self.dtypes[eid])

    def input_names(self) -> list[str]:
        """Names of the arg nodes that are user inputs (not parameters), in arg order."""
        params = set(self.params)
        return [self.nodes[n].name for n in self.arg_nodes if self.nodes[n].name not in params]

    def describe_node(self, nid: int) -> str:
        node = self.nodes[nid]
        what = f"'{node.func_name}'" if node.op == "tvm_op" else "(input)"
        return f"node {nid} '{node.name}' {what}"

    # ---- JSON ---------------------------------------------------------------------------
    def to_json(self) -> str:
        attrs: dict[str, Any] = {
            "shape": ["list_shape", [list(s) for s in self.shapes]],
            "dltype": ["list_str", list(self.dtypes)],
            "storage_id": ["list_int", list(self.storage_ids)],
        }
        if self.device_index is not None:
            attrs["device_index"] = ["list_int", list(self.device_index)]
        for key, col in self.extra_columns.items():
            attrs[key] = ["list_int", list(col)]
        doc: dict[str, Any] = {
            "nodes": [n.to_json() for n in self.nodes],
            "arg_nodes": list(self.arg_nodes),
            "node_row_ptr": list(self.node_row_ptr),
            "heads": [list(h) for h in self.heads],
            "attrs": attrs,
        }
        section: dict[str, Any] = {"version": FORMAT_VERSION, "params": list(self.params)}
        if self.device_names is not None:
            section["devices"] = list(self.device_names)
        if self.pool_bytes is not None:
            section["pool_bytes"] = list(self.pool_bytes)
            section["storage_offset"] = list(self.storage_offset or [])
        doc["hgrt"] = section
        return json.dumps(doc, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes | dict) -> Graph:
        """Parse and validate a graph JSON; every defect is a ``GraphError`` naming its place."""
        if isinstance(text, dict):
            doc = text
        else:
            try:
                doc = json.loads(text)
            except (TypeError, ValueError) as e:
                raise GraphError(f"graph JSON does not parse: {e}") from e
        return _parse(doc)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a TVM dtype string (sub-byte types round up to one byte)."""
    try:
        import tvm

        t = tvm.runtime.DataType(dtype)
        return max(1, (t.bits * t.lanes + 7) // 8)
    except Exception as e:  # noqa: BLE001 - TVM raises several types for a bad dtype string
        raise GraphError(f"unknown dtype {dtype!r}") from e


# ---- parsing and validation ---------------------------------------------------------------

def _require(doc: dict, key: str, kind: type, where: str) -> Any:
    if key not in doc:
        raise GraphError(f"{where}: missing key {key!r} (has {sorted(doc)})")
    val = doc[key]
    if not isinstance(val, kind) or (kind is int and isinstance(val, bool)):
        raise GraphError(f"{where}: {key!r} must be a {kind.__name__}, got {type(val).__name__}")
    return val


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise GraphError(f"{where}: expected an integer, got {v!r}")
    return v


def _entry_ref(v: Any, where: str) -> tuple[int, int, int]:
    if not isinstance(v, (list, tuple)) or len(v) not in (2, 3):
        raise GraphError(f"{where}: an entry reference is [node_id, index, version], got {v!r}")
    nid = _int(v[0], where)
    idx = _int(v[1], where)
    ver = _int(v[2], where) if len(v) == 3 else 0
    return nid, idx, ver


def _column(attrs: dict, key: str, tag: str, n: int) -> list | None:
    if key not in attrs:
        return None
    col = attrs[key]
    if (not isinstance(col, list) or len(col) != 2 or col[0] != tag
            or not isinstance(col[1], list)):
        raise GraphError(f"attrs column {key!r}: expected [{tag!r}, [...]], got {str(col)[:80]}")
    if len(col[1]) != n:
        raise GraphError(
            f"attrs column {key!r} has {len(col[1])} values but the graph has {n} entries "
            f"(node_row_ptr[-1])")
    return col[1]


def _parse(doc: Any) -> Graph:
    if not isinstance(doc, dict):
        raise GraphError(f"graph JSON must be an object, got {type(doc).__name__}")
    raw_nodes = _require(doc, "nodes", list, "graph")
    arg_nodes = [_int(a, "arg_nodes") for a in _require(doc, "arg_nodes", list, "graph")]
    row_ptr = [_int(a, "node_row_ptr") for a in _require(doc, "node_row_ptr", list, "graph")]
    raw_heads = _require(doc, "heads", list, "graph")
    attrs = _require(doc, "attrs", dict, "graph")

    nodes: list[Node] = []
    for nid, raw in enumerate(raw_nodes):
        where = f"node {nid}"
        if not isinstance(raw, dict):
            raise GraphError(f"{where}: must be an object, got {type(raw).__name__}")
        op = _require(raw, "op", str, where)
        name = _require(raw, "name", str, where)
        where = f"node {nid} '{name}'"
        if op not in _KNOWN_OPS:
            raise GraphError(f"{where}: op {op!r} is not one of {list(_KNOWN_OPS)}")
        inputs = [_entry_ref(i, f"{where} input") for i in _require(raw, "inputs", list, where)]
        node_attrs = raw.get("attrs", raw.get("param", {})) or {}
        if not isinstance(node_attrs, dict):
            raise GraphError(f"{where}: attrs must be an object")
        node_attrs = {str(k): str(v) for k, v in node_attrs.items()}
        if op == "tvm_op":
            if "func_name" not in node_attrs:
                raise GraphError(f"{where}: tvm_op without attrs.func_name")
            for key in ("num_outputs", "num_inputs"):
                if key in node_attrs and not node_attrs[key].lstrip("-").isdigit():
                    raise GraphError(f"{where}: attrs.{key} = {node_attrs[key]!r} is not an "
                                     f"integer")
            if int(node_attrs.get("num_outputs", "1")) < 1:
                raise GraphError(f"{where}: num_outputs must be >= 1")
            if "num_inputs" in node_attrs and int(node_attrs["num_inputs"]) != len(inputs):
                raise GraphError(f"{where}: num_inputs = {node_attrs['num_inputs']} but the node "
                                 f"lists {len(inputs)} inputs")
        elif inputs:
            raise GraphError(f"{where}: a 'null' node cannot have inputs")
        nodes.append(Node(op, name, inputs, node_attrs))

    n_nodes = len(nodes)
    if len(row_ptr) != n_nodes + 1:
        raise GraphError(f"node_row_ptr has {len(row_ptr)} values, expected {n_nodes + 1} "
                         f"(number of nodes + 1)")
    if row_ptr[0] != 0:
        raise GraphError(f"node_row_ptr[0] must be 0, got {row_ptr[0]}")
    for nid, node in enumerate(nodes):
        if row_ptr[nid + 1] - row_ptr[nid] != node.num_outputs:
            raise GraphError(
                f"node {nid} '{node.name}': node_row_ptr gives it {row_ptr[nid + 1] - row_ptr[nid]}"
                f" outputs but it declares {node.num_outputs}")
    n_entries = row_ptr[-1]

    for nid, node in enumerate(nodes):
        for nid_in, idx, _ in node.inputs:
            if not 0 <= nid_in < n_nodes:
                raise GraphError(f"node {nid} '{node.name}': input refers to node {nid_in}, which "
                                 f"does not exist ({n_nodes} nodes)")
            if nid_in >= nid:
                raise GraphError(f"node {nid} '{node.name}': input refers to node {nid_in}, which "
                                 f"comes later (nodes must be topologically sorted)")
            if not 0 <= idx < nodes[nid_in].num_outputs:
                raise GraphError(f"node {nid} '{node.name}': input refers to output {idx} of node "
                                 f"{nid_in} '{nodes[nid_in].name}', which has "
                                 f"{nodes[nid_in].num_outputs}")
    seen_args = set()
    for a in arg_nodes:
        if not 0 <= a < n_nodes:
            raise GraphError(f"arg_nodes: node {a} does not exist ({n_nodes} nodes)")
        if nodes[a].op != "null":
            raise GraphError(f"arg_nodes: node {a} '{nodes[a].name}' is a {nodes[a].op}, not an "
                             f"input ('null')")
        if a in seen_args:
            raise GraphError(f"arg_nodes: node {a} '{nodes[a].name}' is listed twice")
        seen_args.add(a)
    for nid, node in enumerate(nodes):
        if node.op == "null" and nid not in seen_args:
            raise GraphError(f"node {nid} '{node.name}' is a 'null' node missing from arg_nodes")
    names = [nodes[a].name for a in arg_nodes]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GraphError(f"arg_nodes: input names must be unique, repeated: {dup}")

    heads = []
    for h in raw_heads:
        nid, idx, ver = _entry_ref(h, "heads")
        if not 0 <= nid < n_nodes or not 0 <= idx < nodes[nid].num_outputs:
            raise GraphError(f"heads: [{nid}, {idx}] does not name an existing node output")
        heads.append((nid, idx, ver))

    shapes_raw = _column(attrs, "shape", "list_shape", n_entries)
    dtypes = _column(attrs, "dltype", "list_str", n_entries)
    sids_raw = _column(attrs, "storage_id", "list_int", n_entries)
    for key, col in (("shape", shapes_raw), ("dltype", dtypes), ("storage_id", sids_raw)):
        if col is None:
            raise GraphError(f"attrs: missing column {key!r} (has {sorted(attrs)})")
    shapes = []
    for eid, s in enumerate(shapes_raw):
        if not isinstance(s, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                          for d in s):
            raise GraphError(f"attrs column 'shape', entry {eid}: {s!r} is not a list of "
                             f"non-negative integers")
        shapes.append(tuple(s))
    for eid, d in enumerate(dtypes):
        if not isinstance(d, str):
            raise GraphError(f"attrs column 'dltype', entry {eid}: {d!r} is not a string")
        try:
            dtype_bytes(d)
        except GraphError as e:
            raise GraphError(f"attrs column 'dltype', entry {eid}: {e}") from None
    sids = [_int(s, f"attrs column 'storage_id', entry {eid}") for eid, s in enumerate(sids_raw)]
    if any(s < 0 for s in sids):
        eid = next(i for i, s in enumerate(sids) if s < 0)
        raise GraphError(f"attrs column 'storage_id', entry {eid}: negative storage id {sids[eid]}")
    dev_col = _column(attrs, "device_index", "list_int", n_entries)
    dev_idx = None
    if dev_col is not None:
        dev_idx = [_int(d, f"attrs column 'device_index', entry {eid}")
                   for eid, d in enumerate(dev_col)]
        if any(d < 0 for d in dev_idx):
            eid = next(i for i, d in enumerate(dev_idx) if d < 0)
            raise GraphError(f"attrs column 'device_index', entry {eid}: negative index")
    extra = {}
    for key, col in attrs.items():
        if key in ("shape", "dltype", "storage_id", "device_index"):
            continue
        if isinstance(col, list) and len(col) == 2 and col[0] == "list_int":
            extra[key] = _column(attrs, key, "list_int", n_entries)
        # other unknown columns are ignored, as TVM's executor did

    g = Graph(nodes, arg_nodes, row_ptr, heads, shapes, dtypes, sids, dev_idx, extra)
    _parse_section(doc.get("hgrt"), g)
    _check_storage(g)
    check_lifetimes(g)
    return g


def _parse_section(section: Any, g: Graph) -> None:
    if section is None:
        return
    if not isinstance(section, dict):
        raise GraphError("'hgrt' section must be an object")
    version = section.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise GraphError(f"'hgrt' section: format version {version!r} is not supported "
                         f"(this hgrt reads version {FORMAT_VERSION})")
    params = section.get("params", [])
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise GraphError("'hgrt' section: params must be a list of input names")
    arg_names = {g.nodes[a].name for a in g.arg_nodes}
    for p in params:
        if p not in arg_names:
            raise GraphError(f"'hgrt' section: param {p!r} is not an input node")
    g.params = params
    names = section.get("devices")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise GraphError("'hgrt' section: devices must be a list of device names")
        g.device_names = names
    if "pool_bytes" not in section:
        return
    pools = section["pool_bytes"]
    offsets = section.get("storage_offset")
    if not isinstance(pools, list) or not all(isinstance(b, int) and b >= 0 for b in pools):
        raise GraphError("'hgrt' section: pool_bytes must be a list of byte counts, one per device")
    n_storage = max(g.storage_ids, default=-1) + 1
    if not isinstance(offsets, list) or len(offsets) != n_storage:
        raise GraphError(f"'hgrt' section: storage_offset must list one byte offset per storage "
                         f"id ({n_storage}), got {str(offsets)[:80]}")
    for sid, off in enumerate(offsets):
        if isinstance(off, bool) or not isinstance(off, int) or off < 0:
            raise GraphError(f"'hgrt' section: storage_offset[{sid}] = {off!r} is not a byte "
                             f"offset")
    g.pool_bytes = pools
    g.storage_offset = offsets


def _check_storage(g: Graph) -> None:
    """A storage id lives on one device; with a pool plan, every entry fits in its pool."""
    owner: dict[int, tuple[int, int]] = {}
    for eid, sid in enumerate(g.storage_ids):
        dev = g.entry_device(eid)
        if sid in owner and owner[sid][0] != dev:
            raise GraphError(
                f"storage id {sid} is used on device {owner[sid][0]} (entry {owner[sid][1]}) and "
                f"on device {dev} (entry {eid}): a storage belongs to one device")
        owner.setdefault(sid, (dev, eid))
    if g.pool_bytes is None:
        return
    for eid, sid in enumerate(g.storage_ids):
        dev = g.entry_device(eid)
        if dev >= len(g.pool_bytes):
            raise GraphError(f"entry {eid} is on device {dev} but the 'hgrt' section plans pools "
                             f"for {len(g.pool_bytes)} devices")
        end = g.storage_offset[sid] + g.entry_bytes(eid)
        if end > g.pool_bytes[dev]:
            raise GraphError(f"entry {eid} (storage {sid}) ends at byte {end}, past the "
                             f"{g.pool_bytes[dev]}-byte pool of device {dev}")


# ---- lifetimes: no two entries live at once may share bytes --------------------------------

def live_ranges(g: Graph) -> dict[int, tuple[int, int, list[int]]]:
    """Entry groups and the steps they are live in: ``root eid -> (first, last, members)``.

    A ``__nop`` output joins its input's group (it is the same bytes). Steps are node ids;
    inputs and params are live from before the first step and graph outputs to after the last,
    so a run can be repeated without setting them again.
    """
    end = len(g.nodes)
    root = list(range(g.num_entries))
    for nid, node in enumerate(g.nodes):
        if node.func_name == NOP_FUNC and len(node.inputs) == 1:
            src = g.entry_id(node.inputs[0][0], node.inputs[0][1])
            root[g.entry_id(nid)] = root[src]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for nid, node in enumerate(g.nodes):
        for k in range(node.num_outputs):
            eid = g.entry_id(nid, k)
            r = root[eid]
            members.setdefault(r, []).append(eid)
            start = -1 if node.op == "null" else nid
            first[r] = min(first.get(r, start), start)
            last[r] = max(last.get(r, start), end if node.op == "null" else start)
        for src_nid, idx, _ in node.inputs:
            r = root[g.entry_id(src_nid, idx)]
            last[r] = max(last[r], nid)
    for nid, idx, _ in g.heads:
        last[root[g.entry_id(nid, idx)]] = end
    return {r: (first[r], last[r], members[r]) for r in members}


def find_overlap(g: Graph) -> tuple[int, int, int] | None:
    """The first (entry, entry, step) whose bytes overlap while both are live, or None."""
    regions = []  # (device, region, byte_start, byte_end, first, last, eid)
    for r, (lo, hi, group) in live_ranges(g).items():
        nbytes = max(g.entry_bytes(e) for e in group)
        if nbytes == 0:
            continue
        sid = g.storage_ids[r]
        if g.pool_bytes is not None:
            start = g.storage_offset[sid]
            regions.append((g.entry_device(r), -1, start, start + nbytes, lo, hi, r))
        else:
            regions.append((g.entry_device(r), sid, 0, nbytes, lo, hi, r))
    regions.sort(key=lambda t: (t[0], t[1], t[4]))
    active: list[tuple] = []
    for reg in regions:
        active = [a for a in active if a[0] == reg[0] and a[1] == reg[1] and a[5] >= reg[4]]
        for a in active:
            if a[2] < reg[3] and reg[2] < a[3]:
                return a[6], reg[6], reg[4]
        active.append(reg)
    return None


def check_lifetimes(g: Graph) -> None:
    """Refuse a memory plan in which two entries that are live at once share bytes."""
    hit = find_overlap(g)
    if hit is None:
        return
    a, b, step = hit
    where = (f"storage {g.storage_ids[a]}" if g.pool_bytes is None else
             f"pool bytes [{g.storage_offset[g.storage_ids[a]]}, ...) and "
             f"[{g.storage_offset[g.storage_ids[b]]}, ...)")
    raise GraphError(f"memory plan: entries {a} and {b} on device {g.entry_device(a)} share "
                     f"{where} while both are live (at node {max(step, 0)} "
                     f"'{g.nodes[max(step, 0)].name}')")


ALIGN = 64  # bytes: every storage of an hgrt memory plan starts at a multiple of this


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class DeviceMemory:
    """Bytes of one device's arena: planned, the lower bound (most bytes live at once, so no
    plan can do better), and the total without any reuse. Sizes are rounded up to ``ALIGN``."""

    device: int
    planned_bytes: int
    lower_bound: int
    no_reuse_bytes: int


def memory_report(g: Graph) -> list[DeviceMemory]:
    """Per device: planned bytes (the ``hgrt`` pools, else one buffer per storage id), the lower
    bound over the live ranges of entry groups, and the no-reuse total."""
    n_dev = 1 + max(g.device_index or [0])
    if g.pool_bytes is not None:
        n_dev = max(n_dev, len(g.pool_bytes))
    no_reuse = [0] * n_dev
    events: list[list[tuple[int, int]]] = [[] for _ in range(n_dev)]
    for root, (lo, hi, group) in live_ranges(g).items():
        dev = g.entry_device(root)
        nbytes = align(max(g.entry_bytes(e) for e in group))
        no_reuse[dev] += nbytes
        events[dev].append((lo, nbytes))
        events[dev].append((hi + 1, -nbytes))  # live through step hi inclusive
    lower = []
    for ev in events:
        live = peak = 0
        for _, delta in sorted(ev):  # at one step, frees (negative) before allocations
            live += delta
            peak = max(peak, live)
        lower.append(peak)
    if g.pool_bytes is not None:
        planned = list(g.pool_bytes) + [0] * (n_dev - len(g.pool_bytes))
    else:
        size: dict[int, int] = {}
        for eid, sid in enumerate(g.storage_ids):
            size[sid] = max(size.get(sid, 0), align(g.entry_bytes(eid)))
        planned = [0] * n_dev
        for sid, eid in {sid: eid for eid, sid in reversed(list(enumerate(g.storage_ids)))
                         }.items():
            planned[g.entry_device(eid)] += size[sid]
    return [DeviceMemory(d, p, lb, nr)
            for d, (p, lb, nr) in enumerate(zip(planned, lower, no_reuse, strict=True))]


def op_label(func_name: str) -> str:
    """A kernel's function name as a person would say it: ``fused_conv2d3_add2_llvm_relu2_llvm``
    → ``conv2d+add+relu``."""
    parts = [p for p in func_name.split("_") if p not in ("fused", "llvm", "cuda", "")]
    words: list[str] = []
    for p in parts:
        p = p.rstrip("0123456789") or p
        if p in ("dims", "dim", "to", "pool2d", "2d") and words:  # expand_dims, broadcast_to
            words[-1] += "_" + p
        elif not words or words[-1] != p:
            words.append(p)
    return "+".join(words)[:40]

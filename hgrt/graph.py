"""The hgrt graph: TVM's classic graph-executor JSON, plus a ``device_index`` column and an
optional ``hgrt`` section with the device-aware memory plan.

Layout (docs/architecture.md, "The graph JSON")::

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

Here: the model (``Node``, ``Graph``), its JSON written (``Graph.to_json``) and read, each field
in its form (``Graph.from_json``); what the fields must agree on is checked by
``hgrt.graph_checks``.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from hgrt import lifetimes, providers
from hgrt.errors import GraphError
from hgrt.graph_checks import (
    check_edges,
    check_pools,
    check_special_ops,
    check_streams,
    check_weight_storages,
    concat_axis,
    concat_problem,
    read_section,
)
from hgrt.graph_format import (
    CONCAT_FUNC,
    COPY_FUNC,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    NOP_FUNC,
    SLICE_FUNC,
)

__all__ = ["CONCAT_FUNC", "COPY_FUNC", "ELEMWISE_MAX", "FORMAT_VERSION", "FORMAT_VERSIONS",
           "INJECTIVE", "MAX_ENTRY_BYTES", "NODE_ATTRS", "NOP_FUNC", "OPAQUE", "SLICE_FUNC",
           "Graph", "Node", "concat_axis", "concat_problem", "dtype_bytes"]

MAX_ENTRY_BYTES = 1 << 48  # one tensor's bytes at most (256 TiB): shapes beyond are refused
_KNOWN_OPS = ("null", "tvm_op")
# node attrs hgrt reads, and the form their (string) values must have
NODE_ATTRS = {"func_name": r"\S+", "num_inputs": r"\d+", "num_outputs": r"\d+",
              "flatten_data": r"[01]", "op_pattern": r"\d", "inplace": r"\d+",
              "flops": r"\d+", "byte_offset": r"\d+"}
# TVM's op pattern kinds (``op_pattern``, a kernel's): up to kInjective a kernel only maps or
# moves elements (elementwise, broadcast, reshape, transpose, concatenate); above it reduces.
ELEMWISE_MAX = 1  # kElemWise, kBroadcast: what FuseOps folds into the kernel before
INJECTIVE = 2
OPAQUE = 8  # kOpaque: FuseOps fuses nothing into or after such a call


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
        return self.attrs.get("flatten_data", "0") == "1"

    @property
    def inplace(self) -> int | None:
        """The input whose bytes output 0 may be written over (``attrs.inplace``): the kernel
        reads each element of it before writing the same element of the output (oneDNN's sum
        post-op). The memory plan takes the offer only where that input dies here."""
        k = self.attrs.get("inplace") if self.op == "tvm_op" else None
        return None if k is None else int(k)

    @property
    def byte_offset(self) -> int:
        """Where a ``__slice`` view starts in its input's bytes (``attrs.byte_offset``)."""
        return int(self.attrs.get("byte_offset", "0"))

    @property
    def injective(self) -> bool:
        """A kernel that only maps or moves elements (TVM op pattern <= kInjective); False
        when the graph does not say."""
        return int(self.attrs.get("op_pattern", "9")) <= INJECTIVE

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
    weight_pool_bytes: list[int] | None = None  # hgrt section: params apart, one pool per device
    streams: list[int] | None = None  # hgrt section: per node its stream (-1: does not run)
    waits: list[list[int]] | None = None  # hgrt section: per node, nodes of other streams
    # hgrt section: per device what its kernels need of a CPU ({"arch", "features"}; None for a
    # device that is not a CPU): devices.cpu_requirements, checked at create
    cpu_needs: list[dict | None] | None = None

    # ---- derived views ------------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return self.node_row_ptr[-1]

    def entry_id(self, nid: int, index: int = 0) -> int:
        return self.node_row_ptr[nid] + index

    def entry_device(self, eid: int) -> int:
        return self.device_index[eid] if self.device_index is not None else 0

    def entry_bytes(self, eid: int) -> int:
        return math.prod(self.shapes[eid]) * dtype_bytes(self.dtypes[eid])

    def input_names(self) -> list[str]:
        """Names of the arg nodes that are user inputs (not parameters), in arg order."""
        params = set(self.params)
        return [self.nodes[n].name for n in self.arg_nodes if self.nodes[n].name not in params]

    @functools.cached_property
    def weight_storages(self) -> frozenset[int]:
        """Storage ids holding parameters: in each device's weight pool when the plan has one
        (``weight_pool_bytes``), so that call frames and other modules share them."""
        params = set(self.params)
        return frozenset(self.storage_ids[self.entry_id(n)] for n in self.arg_nodes
                         if self.nodes[n].name in params)

    def pool_of(self, eid: int) -> tuple[int, bool]:
        """(device, is the weight pool) of the pool entry ``eid`` lives in (hgrt plan)."""
        weight = self.weight_pool_bytes is not None and \
            self.storage_ids[eid] in self.weight_storages
        return self.entry_device(eid), weight

    def node_of_entry(self, eid: int) -> int:
        return bisect.bisect_right(self.node_row_ptr, eid) - 1

    def alias_roots(self) -> list[int]:
        """Per entry, the entry whose bytes it is part of: itself; for a ``__nop`` or ``__slice``
        output (a view) the root of its input; for a piece of a ``__concat`` the root of its
        output."""
        return list(self._view_tree[0])

    def entry_offsets(self) -> list[int]:
        """Per entry, its byte offset from the start of its root's bytes (``alias_roots``):
        0 but for the pieces of a ``__concat``, which lie one after another in its output, and
        a ``__slice``, at its ``byte_offset`` in its input."""
        return self._view_tree[1]

    @functools.cached_property
    def _view_tree(self) -> tuple[list[int], list[int]]:
        """(alias roots, offsets), once per graph (a pass that changes nodes makes a new one)."""
        n = self.num_entries
        parent, rel = list(range(n)), [0] * n
        for nid, node in enumerate(self.nodes):
            if node.func_name == NOP_FUNC and len(node.inputs) == 1:
                links = [(self.entry_id(nid), self.entry_id(*node.inputs[0][:2]), 0)]
            elif node.func_name == SLICE_FUNC and len(node.inputs) == 1:
                links = [(self.entry_id(nid), self.entry_id(*node.inputs[0][:2]),
                          node.byte_offset)]
            elif node.func_name == CONCAT_FUNC:
                links, at = [], 0
                for src, idx, _ in node.inputs:
                    piece = self.entry_id(src, idx)
                    links.append((piece, self.entry_id(nid), at))
                    at += self.entry_bytes(piece)
            else:
                continue
            for child, up, offset in links:
                if parent[child] != child:
                    raise GraphError(f"{self.describe_entry(child)} is a view twice (of entry "
                                     f"{parent[child]} and of entry {up}): a tensor's bytes "
                                     f"have one place")
                parent[child], rel[child] = up, offset
        root, off = list(range(n)), [0] * n
        done = [False] * n
        for e in range(n):
            path = []
            x = e
            while not done[x] and parent[x] != x:  # no cycle: a __nop points to an earlier
                path.append(x)  # entry, a concat piece to a later one, each entry once
                x = parent[x]
            for y in reversed(path):  # nearest the root first
                up = parent[y]
                root[y], off[y] = root[up], off[up] + rel[y]
                done[y] = True
            done[x] = True
        return tuple(root), tuple(off)

    def describe_entry(self, eid: int) -> str:
        """``output 0 of node 3 'conv' ('fused_conv2d'), (1, 8, 4, 4) float32, 512 B``."""
        nid = self.node_of_entry(eid)
        return (f"output {eid - self.node_row_ptr[nid]} of {self.describe_node(nid)}, "
                f"{self.shapes[eid]} {self.dtypes[eid]}, {self.entry_bytes(eid)} B")

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
        funcs = {n.func_name for n in self.nodes}
        version = 3 if SLICE_FUNC in funcs else 2 if CONCAT_FUNC in funcs else 1
        section: dict[str, Any] = {"version": version, "params": list(self.params)}
        if self.device_names is not None:
            section["devices"] = list(self.device_names)
        if self.cpu_needs is not None:
            section["cpu_needs"] = list(self.cpu_needs)
        if self.pool_bytes is not None:
            section["pool_bytes"] = list(self.pool_bytes)
            section["storage_offset"] = list(self.storage_offset or [])
        if self.weight_pool_bytes is not None:
            section["weight_pool_bytes"] = list(self.weight_pool_bytes)
        if self.streams is not None:
            section["streams"] = list(self.streams)
            section["waits"] = [list(w) for w in self.waits or [[] for _ in self.nodes]]
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
            except (TypeError, ValueError, RecursionError) as e:
                raise GraphError(f"graph JSON does not parse: {type(e).__name__}: "
                                 f"{str(e)[:200]}") from None
        return _parse(doc)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a TVM dtype string (sub-byte types round up to one byte)."""
    try:
        import tvm

        t = tvm.runtime.DataType(dtype)
        return max(1, (t.bits * t.lanes + 7) // 8)
    except Exception as e:
        raise GraphError(f"unknown dtype {dtype!r}") from e


# ---- reading the JSON: every field's form (graph_checks: what the fields must agree on) ----

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
    nodes = [_parse_node(nid, raw) for nid, raw in enumerate(_require(doc, "nodes", list, "graph"))]
    row_ptr = [_int(a, "node_row_ptr") for a in _require(doc, "node_row_ptr", list, "graph")]
    check_edges(nodes, row_ptr)
    arg_nodes = _parse_arg_nodes(nodes, _require(doc, "arg_nodes", list, "graph"))
    heads = []
    for h in _require(doc, "heads", list, "graph"):
        nid, idx, ver = _entry_ref(h, "heads")
        if not 0 <= nid < len(nodes) or not 0 <= idx < nodes[nid].num_outputs:
            raise GraphError(f"heads: [{nid}, {idx}] does not name an existing node output")
        heads.append((nid, idx, ver))
    g = Graph(nodes, arg_nodes, row_ptr, heads,
              **_parse_columns(_require(doc, "attrs", dict, "graph"), row_ptr[-1]))
    read_section(doc.get("hgrt"), g)
    check_special_ops(g)
    check_streams(g)
    lifetimes.storage_devices(g, GraphError)
    check_weight_storages(g)
    check_pools(g)
    lifetimes.check_lifetimes(g, GraphError)
    return g


def _parse_node(nid: int, raw: Any) -> Node:
    where = f"node {nid}"
    if not isinstance(raw, dict):
        raise GraphError(f"{where}: must be an object, got {type(raw).__name__}")
    op = _require(raw, "op", str, where)
    name = _require(raw, "name", str, where)
    where = f"node {nid} '{name}'"
    if op not in _KNOWN_OPS:
        raise GraphError(f"{where}: op {op!r} is not one of {list(_KNOWN_OPS)}")
    inputs = [_entry_ref(i, f"{where} input") for i in _require(raw, "inputs", list, where)]
    attrs = raw.get("attrs", raw.get("param", {})) or {}
    if not isinstance(attrs, dict):
        raise GraphError(f"{where}: attrs must be an object")
    for key, allowed in NODE_ATTRS.items():  # strict, as TVM's loader: strings of known form
        if key in attrs and not (isinstance(attrs[key], str) and re.fullmatch(allowed, attrs[key])):
            raise GraphError(f"{where}: attrs.{key} = {attrs[key]!r} must be a string matching "
                             f"{allowed!r}")
    attrs = {str(k): str(v) for k, v in attrs.items()}
    if op == "null":
        if inputs:
            raise GraphError(f"{where}: a 'null' node cannot have inputs")
        return Node(op, name, inputs, attrs)
    if "func_name" not in attrs:
        raise GraphError(f"{where}: tvm_op without attrs.func_name")
    if int(attrs.get("num_outputs", "1")) < 1:
        raise GraphError(f"{where}: num_outputs must be >= 1")
    if "num_inputs" in attrs and int(attrs["num_inputs"]) != len(inputs):
        raise GraphError(f"{where}: num_inputs = {attrs['num_inputs']} but the node lists "
                         f"{len(inputs)} inputs")
    if "inplace" in attrs and int(attrs["inplace"]) >= len(inputs):
        raise GraphError(f"{where}: attrs.inplace = {attrs['inplace']} names no input (it has "
                         f"{len(inputs)})")
    provider = providers.of_node(attrs)
    if "inplace" in attrs and not (provider and provider.inplace):
        inplace = [p.name for p in providers.registered() if p.inplace]
        raise GraphError(f"{where}: attrs.inplace on a kernel of provider "
                         f"{attrs.get('provider', providers.DEFAULT)!r}: only {inplace} "
                         f"kernels read each element of the input before writing it")
    return Node(op, name, inputs, attrs)


def _parse_arg_nodes(nodes: list[Node], raw: list) -> list[int]:
    """Every 'null' node is listed once in arg_nodes, and only those; names are unique."""
    arg_nodes = [_int(a, "arg_nodes") for a in raw]
    seen: set[int] = set()
    for a in arg_nodes:
        if not 0 <= a < len(nodes):
            raise GraphError(f"arg_nodes: node {a} does not exist ({len(nodes)} nodes)")
        if nodes[a].op != "null":
            raise GraphError(f"arg_nodes: node {a} '{nodes[a].name}' is a {nodes[a].op}, not an "
                             f"input ('null')")
        if a in seen:
            raise GraphError(f"arg_nodes: node {a} '{nodes[a].name}' is listed twice")
        seen.add(a)
    for nid, node in enumerate(nodes):
        if node.op == "null" and nid not in seen:
            raise GraphError(f"node {nid} '{node.name}' is a 'null' node missing from arg_nodes")
    names = [nodes[a].name for a in arg_nodes]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GraphError(f"arg_nodes: input names must be unique, repeated: {dup}")
    return arg_nodes


def _int_column(attrs: dict, key: str, n: int) -> list[int] | None:
    col = _column(attrs, key, "list_int", n)
    if col is None:
        return None
    values = [_int(v, f"attrs column {key!r}, entry {eid}") for eid, v in enumerate(col)]
    if any(v < 0 for v in values):
        eid = next(i for i, v in enumerate(values) if v < 0)
        raise GraphError(f"attrs column {key!r}, entry {eid}: negative value {values[eid]}")
    return values


def _parse_columns(attrs: dict, n: int) -> dict[str, Any]:
    """The per-entry columns: shapes, dtypes, storage ids, device indices, unknown list_int."""
    for key in ("shape", "dltype", "storage_id"):
        if key not in attrs:
            raise GraphError(f"attrs: missing column {key!r} (has {sorted(attrs)})")
    shapes = []
    for eid, s in enumerate(_column(attrs, "shape", "list_shape", n)):
        if not isinstance(s, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                          for d in s):
            raise GraphError(f"attrs column 'shape', entry {eid}: {s!r} is not a list of "
                             f"non-negative integers")
        shapes.append(tuple(s))
    dtypes = _column(attrs, "dltype", "list_str", n)
    for eid, d in enumerate(dtypes):
        if not isinstance(d, str):
            raise GraphError(f"attrs column 'dltype', entry {eid}: {d!r} is not a string")
        try:
            nbytes = math.prod(shapes[eid]) * dtype_bytes(d)
        except GraphError as e:
            raise GraphError(f"attrs column 'dltype', entry {eid}: {e}") from None
        if nbytes > MAX_ENTRY_BYTES:  # sizes past int64 would wrap in TVM's own arithmetic
            raise GraphError(f"entry {eid}: shape {list(shapes[eid])} of {d} is {nbytes} bytes, "
                             f"more than hgrt allocates for one tensor ({MAX_ENTRY_BYTES})")
    extra = {key: _int_column(attrs, key, n) for key, col in attrs.items()
             if key not in ("shape", "dltype", "storage_id", "device_index")
             and isinstance(col, list) and len(col) == 2 and col[0] == "list_int"}
    # other unknown columns are ignored, as TVM's executor did
    return {"shapes": shapes, "dtypes": dtypes, "storage_ids": _int_column(attrs, "storage_id", n),
            "device_index": _int_column(attrs, "device_index", n), "extra_columns": extra}

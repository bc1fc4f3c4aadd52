"""concat_views: concatenations whose pieces their kernels write in place, in the output's bytes.

A TVM ``concatenate`` kernel reads every piece and writes it again: DenseNet concatenates all
earlier features before each of its layers (the copies grow with the square of a block's
depth: 54 concat kernels, 1.4 ms of a 24 ms run on this host with TVM kernels), Inception the
results of its branches. In NCHW with a batch of one, the pieces of a concat on channels are
consecutive byte ranges of its output; so is any concat along an axis after only 1-sized
dimensions. Then the kernel that makes each piece can write it straight there: the node becomes
a ``__concat`` (a view: no step runs), its pieces share its storage at their offsets
(``Graph.entry_offsets``), and the memory plan sizes the lot as one group, live from its first
piece's writer to its last reader (``lifetimes``). A concat that is itself a piece nests
(DenseNet's chain of concats is one buffer per block).

Taken only where it stays exact and safe: a plain TVM concatenate (nothing fused into it), on
one device, every piece the output of a step that runs (not an input, a weight or a view), a
piece of no other concat, no piece twice, each piece at a multiple of ``ALIGN`` bytes (kernels
may assume aligned data). oneDNN's NHWC concat is left alone (its pieces are not consecutive).
Runs after graph_codegen, before assign_streams: streams and events see each piece's writer
(``entry_writers``); ``Graph.from_json`` checks every ``__concat`` of a graph it loads.
"""

from __future__ import annotations

import dataclasses

from hgrt.graph import CONCAT_FUNC, Graph, Node, concat_axis, op_label
from hgrt.lifetimes import ALIGN, runs


def _pieces_fit(g: Graph, nid: int, taken: set[int]) -> bool:
    node = g.nodes[nid]
    out = g.entry_id(nid)
    pieces = [g.entry_id(src, idx) for src, idx, _ in node.inputs]
    if (len(pieces) < 2 or len(set(pieces)) != len(pieces) or taken.intersection(pieces)
            or concat_axis([g.shapes[p] for p in pieces], g.shapes[out]) is None):
        return False
    at = 0
    for p in pieces:
        source = g.nodes[g.node_of_entry(p)]
        written = runs(source) or source.func_name == CONCAT_FUNC
        if (not written or at % ALIGN or g.dtypes[p] != g.dtypes[out]
                or g.entry_device(p) != g.entry_device(out)):
            return False
        at += g.entry_bytes(p)
    return True


def concat_views(graph: Graph, ctx: object = None) -> Graph:
    """``graph`` with every concatenation that can be one (see the module doc) as a
    ``__concat`` view of pieces written in place."""
    nodes = list(graph.nodes)
    g = dataclasses.replace(graph, nodes=nodes)
    taken: set[int] = set()
    done = total = 0
    for nid, node in enumerate(nodes):
        if not runs(node) or op_label(node.func_name or "") != "concatenate":
            continue
        total += 1
        if node.num_outputs != 1 or node.attrs.get("provider") or not _pieces_fit(g, nid, taken):
            continue
        taken.update(g.entry_id(src, idx) for src, idx, _ in node.inputs)
        nodes[nid] = Node("tvm_op", node.name, list(node.inputs), {
            "func_name": CONCAT_FUNC, "num_inputs": str(len(node.inputs)), "num_outputs": "1",
            "flatten_data": "0"})
        done += 1
    if total and ctx is not None and hasattr(ctx, "log"):
        ctx.log(f"concat_views: {done} of {total} concatenations written in place by the "
                f"kernels of their pieces")
    return g

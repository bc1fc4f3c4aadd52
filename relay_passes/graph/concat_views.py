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

Taken only where it stays exact and safe: a plain TVM concatenate (nothing fused into it: a
fused concat of concats takes its inputs in another order than it lays them out), on one
device whose pointers allow arithmetic (CPU, CUDA), every piece the output of a step that runs
(not an input, a weight or a view), a piece of no other concat, no piece twice, each piece at a
multiple of ``ALIGN`` bytes (kernels may assume aligned data): ``graph.concat_problem``, the
check ``Graph.from_json`` makes of every ``__concat`` too. oneDNN's NHWC concat is left alone
(its pieces are not consecutive bytes, and oneDNN 3.2 runs a convolution writing a channel
slice of a wider NHWC tensor in its reference code, 200x slower).
"""

from __future__ import annotations

import dataclasses
import re

from hgrt import devices as hdev
from hgrt.errors import DeviceError
from hgrt.graph import CONCAT_FUNC, Graph, Node, concat_problem
from hgrt.lifetimes import runs
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.pipeline import contract

# a plain TVM concatenate kernel: ``concatenate``, ``concatenate3_llvm`` (a fused one,
# ``fused_concatenate_concatenate1``, takes its inputs in another order than its bytes)
PLAIN_CONCAT = re.compile(r"concatenate\d*(_(llvm|cuda|rocm))?")


def _on_pointer_device(g: Graph, nid: int, ctx: BuildContext | None) -> bool:
    dev = g.entry_device(g.entry_id(nid))
    devices = None if ctx is None else ctx.devices
    if devices is not None and dev < len(devices):
        return hdev.takes_offset_views(devices[dev])
    names = g.device_names or []
    if dev >= len(names):
        return False
    try:
        return hdev.takes_offset_views(names[dev])
    except DeviceError:  # a name of no kind hgrt knows: no views
        return False


@contract(reads={"devices"}, after=("graph_codegen",))
def concat_views(graph: Graph, ctx: BuildContext | None = None) -> Graph:
    """``graph`` with every concatenation that can be one (see the module doc) as a
    ``__concat`` view of pieces written in place."""
    nodes = list(graph.nodes)
    g = dataclasses.replace(graph, nodes=nodes)
    taken: set[int] = set()
    done = total = 0
    for nid, node in enumerate(nodes):
        if not runs(node) or not PLAIN_CONCAT.fullmatch(node.func_name or ""):
            continue
        total += 1
        pieces = {g.entry_id(src, idx) for src, idx, _ in node.inputs}
        if (node.attrs.get("provider") or len(pieces) < 2 or taken & pieces
                or not _on_pointer_device(g, nid, ctx)
                or concat_problem(g, nid, storage=False) is not None):
            continue
        taken |= pieces
        nodes[nid] = Node("tvm_op", node.name, list(node.inputs), {
            "func_name": CONCAT_FUNC, "num_inputs": str(len(node.inputs)), "num_outputs": "1",
            "flatten_data": "0"})
        done += 1
    g = dataclasses.replace(graph, nodes=nodes)  # (the views of the graph as it now is)
    if total and ctx is not None:
        ctx.log(f"concat_views: {done} of {total} concatenations written in place by the "
                f"kernels of their pieces")
    return g

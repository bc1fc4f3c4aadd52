"""The order a lowered ``main``'s bindings become graph steps in, where a GPU is one of the
devices: GPU work is launched as early and GPU results are waited for as late as the data
allow, so that the CPU computes while the GPU does.

A GPU kernel's launch returns at once; a copy from a GPU to a CPU (``cudaMemcpy`` on the
default stream) waits for every kernel launched before it, and so does a copy to the GPU.
In the order the importer wrote, a CPU op that needs nothing from the GPU may come after such
a copy, and then waits for the GPU for nothing. ``overlap_order`` is a list schedule over the
dataflow (every binding after the ones it reads) that, among the bindings ready to go, takes
first the copies to a GPU (they wait for the GPU's queue, shortest while it is empty), then the
GPU's kernels, then the rest, and the copies from a GPU only when nothing else is ready; ties
keep the written order. A graph without a GPU keeps the written order, binding for binding.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from tvm import relax

from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.relax_util import TO_VDEVICE, op_name

# the rank of a binding among those ready: lower goes first
TO_GPU, ON_GPU, OTHER, FROM_GPU = range(4)


def _rank(b: relax.VarBinding, dev: dict[relax.Var, int], gpu: list[bool]) -> int:
    here = dev.get(b.var)
    on_gpu = here is not None and gpu[here]
    if op_name(b.value) == TO_VDEVICE:
        src = b.value.args[0]
        from_gpu = isinstance(src, relax.Var) and src in dev and gpu[dev[src]]
        return FROM_GPU if from_gpu and not on_gpu else TO_GPU if on_gpu else OTHER
    return ON_GPU if on_gpu else OTHER


def overlap_order(binds: Sequence[relax.VarBinding], dev: dict[relax.Var, int],
                  ctx: BuildContext) -> list[relax.VarBinding]:
    """``binds`` (a lowered ``main``'s, in their written order) in the order to emit them as
    steps; ``dev`` is each variable's device (``binding_devices``)."""
    gpu = [d.is_gpu for d in ctx.devices]
    if not any(gpu) or all(gpu):
        return list(binds)
    index = {b.var: i for i, b in enumerate(binds)}
    readers: list[list[int]] = [[] for _ in binds]
    waiting = [0] * len(binds)
    for i, b in enumerate(binds):
        reads = {index[v] for v in relax.analysis.free_vars(b.value) if v in index}
        waiting[i] = len(reads)
        for j in reads:
            readers[j].append(i)
    ready = [(_rank(b, dev, gpu), i) for i, b in enumerate(binds) if waiting[i] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(binds[i])
        for j in readers[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, (_rank(binds[j], dev, gpu), j))
    assert len(out) == len(binds), "the bindings of main read each other in a cycle"
    return out

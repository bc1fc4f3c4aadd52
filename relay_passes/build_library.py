"""build_library: every PrimFunc compiled, each for its own target, into one runtime module (an
llvm host module with the CUDA module imported, where there is one).
"""

from __future__ import annotations

import functools

import tvm

from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.lowered import failing_kernel
from hgrt.relay_passes.util.pipeline import contract, located
from hgrt.relay_passes.util.relax_util import (
    prim_funcs,
)


@contract(reads={"devices"}, writes={"lowered"}, after=("schedule_cpu", "schedule_gpu"))
def build_library(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """One ``tvm.tirx.build`` over every PrimFunc, each for its own target → one module, in
    ``ctx.lowered.lib``; the IR goes on untouched (to graph_codegen). ``ctx.devices``: the
    host target of a library without kernels."""
    funcs = {name: f.with_attr("global_symbol", name) for name, f in prim_funcs(mod).items()}
    # no kernels (outputs are inputs or weights, rearranged): an empty host library
    host = None if funcs else _host_target(ctx)
    ctx.log(f"building {len(funcs)} PrimFuncs into one library")
    with located(functools.partial(failing_kernel, mod, ctx, funcs, tvm.tirx.build)):
        ctx.lowered.lib = tvm.tirx.build(tvm.IRModule(funcs), target=host)
    return mod


def _host_target(ctx: BuildContext) -> tvm.target.Target:
    """The CPU target of the build: its first CPU device's, else the host of device 0's."""
    cpus = [d.target for d in ctx.devices if not d.is_gpu]
    first = ctx.devices[0].target
    return cpus[0] if cpus else (first.host or tvm.target.Target("llvm"))

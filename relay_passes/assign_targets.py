"""assign_targets: every PrimFunc gets the ``target`` of the devices that call it.

What TVM 0.27 gets wrong is repaired from the dataflow, not from the vdevice annotations: a
call's device is the device of its tensor operands (``util/lowered.binding_devices``: LegalizeOps
drops the vdevice of conv / batch_norm outputs), and each PrimFunc's ``target`` attr is set from
the device of its call sites (FuseTIR drops it); a PrimFunc called from devices of two targets is
cloned per target.
"""

from __future__ import annotations

import tvm
from tvm import relax

from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.lowered import binding_devices
from hgrt.relay_passes.util.pipeline import contract
from hgrt.relay_passes.util.relax_util import (
    CALL_TIR,
    bindings,
    op_name,
    prim_funcs,
)


def _rebuild_main(func: relax.Function, rename: dict[tuple[str, int], tvm.ir.GlobalVar],
                  dev: dict[relax.Var, int]) -> relax.Function:
    blocks = []
    for block in func.body.blocks:
        bound = []
        for b in block.bindings:
            value = b.value
            key = (value.args[0].name_hint, dev[b.var]) if op_name(value) == CALL_TIR else None
            if key in rename:
                value = relax.Call(value.op, [rename[key], *value.args[1:]], value.attrs,
                                   value.ty_args)
            bound.append(relax.VarBinding(b.var, value))
        blocks.append(type(block)(bound))
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                          func.is_pure, func.attrs)


@contract(reads={"devices"}, after=("legalize_and_fuse",))  # FuseTIR drops the target attr
def assign_targets(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Give every PrimFunc the target of the devices that call it (cloned per target)."""
    main = mod["main"]
    dev = binding_devices(main, ctx)
    callers: dict[str, list[int]] = {}
    for b in bindings(main):
        if op_name(b.value) == CALL_TIR:
            callers.setdefault(b.value.args[0].name_hint, []).append(dev[b.var])
    new = mod.clone()
    rename: dict[tuple[str, int], tvm.ir.GlobalVar] = {}
    for fname, devs in sorted(callers.items()):
        gv = new.get_global_var(fname)
        func = new[gv]
        by_target: dict[str, list[int]] = {}
        for d in devs:
            by_target.setdefault(str(ctx.devices[d].target), []).append(d)
        for k, (_, tdevs) in enumerate(sorted(by_target.items())):
            target = ctx.devices[tdevs[0]].target
            if k == 0:
                new.update_func(gv, func.with_attr("target", target))
                continue
            clone_gv = tvm.ir.GlobalVar(f"{fname}_{target.kind.name}{k}")
            new[clone_gv] = func.with_attr("target", target)
            for d in tdevs:
                rename[(fname, d)] = clone_gv
    if rename:
        new.update_func(new.get_global_var("main"), _rebuild_main(new["main"], rename, dev))
    ctx.log(f"lowered to {len(prim_funcs(new))} PrimFuncs")
    return new

"""Readers of a lowered ``main`` (after ``legalize_and_fuse``) that the lowering passes and
``graph_codegen`` share: the device of every tensor variable, found from the dataflow (LegalizeOps
drops the vdevice of conv / batch_norm outputs), and a failing kernel named by its first call.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from hgrt.errors import BuildError
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.relax_util import (
    CALL_TIR,
    TO_VDEVICE,
    bindings,
    op_name,
    site,
    tensor_args,
)

# ops that survive lowering and run as views of their input (RewriteDataflowReshape)
VIEW_OPS = ("relax.reshape",)


def binding_devices(func: relax.Function, ctx: BuildContext) -> dict[relax.Var, int]:
    """Device of every tensor variable of a lowered ``main``, from the dataflow.

    Keyed by the variables themselves: after FuseOps, binding names are no longer unique."""
    dev = {p: ctx.device_of_vdevice(p.ty.vdevice) or 0 for p in func.params}
    pending: list[relax.Var] = []
    users: dict[relax.Var, list[relax.Var]] = {}
    for b in bindings(func):
        var, value = b.var, b.value
        op = op_name(value)
        src = value.tuple_value if isinstance(value, relax.TupleGetItem) else value
        if isinstance(src, relax.Var):
            if src in dev:
                dev[var] = dev[src]
        elif op == TO_VDEVICE:
            dev[var] = ctx.device_of_vdevice(value.attrs.dst_vdevice)
        elif op is not None:
            args = [a for a in tensor_args(value) if isinstance(a, relax.Var)]
            for a in args:
                users.setdefault(a, []).append(var)
            seen = sorted({dev[a] for a in args if a in dev})
            if len(seen) > 1:
                names = [f"{a.name}@{ctx.devices[dev[a]].name}" for a in args if a in dev]
                raise BuildError(f"binding {var.name!r} ({op}) reads tensors on several "
                                 f"devices {names}: a cross-device copy is missing")
            if seen:
                dev[var] = seen[0]
                continue
            vdev = getattr(value.ty_args[0] if value.ty_args else value.ty, "vdevice", None)
            if vdev is not None:
                dev[var] = ctx.device_of_vdevice(vdev)
            else:
                pending.append(var)
    for var in pending:  # no tensor operand, no vdevice: run where the first reader runs
        readers = [dev[u] for u in users.get(var, []) if u in dev]
        dev[var] = readers[0] if readers else 0
    return dev


def kernel_site(mod: tvm.IRModule, ctx: BuildContext, name: str) -> str:
    """PrimFunc ``name`` as the first binding of ``main`` that calls it, with its device."""
    main = mod["main"]
    calls = [b for b in bindings(main)
             if op_name(b.value) == CALL_TIR and b.value.args[0].name_hint == name]
    return site(calls[0], ctx, binding_devices(main, ctx).get(calls[0].var)) if calls \
        else f"kernel {name!r}"


def failing_kernel(mod: tvm.IRModule, ctx: BuildContext, funcs: dict,
                    attempt: Callable[[tvm.IRModule], object]) -> str:
    """The first PrimFunc of ``funcs`` that ``attempt`` fails on alone, as ``kernel_site``."""
    for name, f in funcs.items():
        try:
            attempt(tvm.IRModule({name: f}))
        except Exception:
            return kernel_site(mod, ctx, name)
    return "no kernel fails alone"

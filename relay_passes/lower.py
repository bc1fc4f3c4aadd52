"""lower: Relax ops → ``R.call_tir`` into fused PrimFuncs, each with the target of its device.

TVM does the work (LegalizeOps → AnnotateTIROpPattern → FoldConstant → FuseOps → FuseTIR → DCE);
fusion never crosses devices because every crossing edge is an ``R.to_vdevice`` (not a
call_tir). What TVM 0.27 gets wrong is repaired from the dataflow, not from the vdevice
annotations: a call's device is the device of its tensor operands (LegalizeOps drops the
vdevice of conv / batch_norm outputs), and each PrimFunc's ``target`` attr is set from the
device of its call sites (FuseTIR drops it). GPU PrimFuncs are scheduled with dlight; one left
unscheduled is a ``BuildError`` naming it.
"""

from __future__ import annotations

import os

import tvm
from tvm import relax, tirx

from hgrt.errors import BuildError
from hgrt.relay_passes.context import BuildContext

CALL_TIR = "relax.call_tir"
TO_VDEVICE = "relax.to_vdevice"
# ops that survive lowering and run as views of their input (RewriteDataflowReshape)
VIEW_OPS = ("relax.reshape",)


def _lowering_passes() -> list[tvm.transform.Pass]:
    return [
        # inference batch_norm → elementwise ops that fuse into the convolution before it
        relax.transform.DecomposeOpsForInference("main"),
        relax.transform.CanonicalizeBindings(),  # (y, mean, var)[0] → y: relu may fuse too
        relax.transform.DeadCodeElimination(["main"]),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(["main"]),
        relax.transform.RewriteDataflowReshape(),  # reshape kernels → views (graph "__nop")
    ]


def _op_name(value: relax.Expr) -> str | None:
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


def _tensor_args(value: relax.Call) -> list[relax.Expr]:
    if _op_name(value) == CALL_TIR:
        return list(value.args[1].fields)
    return list(value.args)


def binding_devices(func: relax.Function, ctx: BuildContext) -> dict[relax.Var, int]:
    """Device of every tensor variable of a lowered ``main``, from the dataflow.

    Keyed by the variables themselves: after FuseOps, binding names are no longer unique."""
    dev: dict[relax.Var, int] = {}
    for p in func.params:
        d = ctx.device_of_vdevice(p.ty.vdevice)
        dev[p] = 0 if d is None else d
    pending: list[relax.Var] = []
    users: dict[relax.Var, list[relax.Var]] = {}
    for block in func.body.blocks:
        for b in block.bindings:
            var, value = b.var, b.value
            op = _op_name(value)
            if isinstance(value, relax.Var):
                if value in dev:
                    dev[var] = dev[value]
            elif isinstance(value, relax.TupleGetItem):
                src = value.tuple_value
                if isinstance(src, relax.Var) and src in dev:
                    dev[var] = dev[src]
            elif op == TO_VDEVICE:
                dev[var] = ctx.device_of_vdevice(value.attrs.dst_vdevice)
            elif op is not None:
                args = [a for a in _tensor_args(value) if isinstance(a, relax.Var)]
                for a in args:
                    users.setdefault(a, []).append(var)
                seen = sorted({dev[a] for a in args if a in dev})
                if len(seen) > 1:
                    names = [f"{a.name}@{ctx.devices[dev[a]].name}" for a in args if a in dev]
                    raise BuildError(f"binding {var.name!r} ({op}) reads tensors on several "
                                     f"devices {names}: a cross-device copy is missing")
                if seen:
                    dev[var] = seen[0]
                else:
                    out = value.ty_args[0] if value.ty_args else value.ty
                    vdev = getattr(out, "vdevice", None)
                    if vdev is not None:
                        dev[var] = ctx.device_of_vdevice(vdev)
                    else:
                        pending.append(var)
    for var in pending:  # no tensor operand, no vdevice: run where the first reader runs
        readers = [dev[u] for u in users.get(var, []) if u in dev]
        dev[var] = readers[0] if readers else 0
    return dev


def _rebuild_main(func: relax.Function, rename: dict[tuple[str, int], tvm.ir.GlobalVar],
                  dev: dict[relax.Var, int]) -> relax.Function:
    blocks = []
    for block in func.body.blocks:
        bindings = []
        for b in block.bindings:
            value = b.value
            if _op_name(value) == CALL_TIR:
                key = (value.args[0].name_hint, dev[b.var])
                if key in rename:
                    value = relax.Call(value.op, [rename[key], *value.args[1:]], value.attrs,
                                       value.ty_args)
            bindings.append(relax.VarBinding(b.var, value))
        blocks.append(type(block)(bindings))
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                          func.is_pure, func.attrs)


def _assign_targets(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Give every PrimFunc the target of the devices that call it (cloned per target kind)."""
    main = mod["main"]
    dev = binding_devices(main, ctx)
    callers: dict[str, list[int]] = {}
    for block in main.body.blocks:
        for b in block.bindings:
            if _op_name(b.value) == CALL_TIR:
                callers.setdefault(b.value.args[0].name_hint, []).append(dev[b.var])
    new = mod.clone()
    rename: dict[tuple[str, int], tvm.ir.GlobalVar] = {}
    for fname, devs in sorted(callers.items()):
        gv = new.get_global_var(fname)
        func = new[gv]
        by_kind: dict[str, list[int]] = {}
        for d in devs:
            by_kind.setdefault(str(ctx.devices[d].target), []).append(d)
        for k, (_, kdevs) in enumerate(sorted(by_kind.items())):
            target = ctx.devices[kdevs[0]].target
            if k == 0:
                new.update_func(gv, func.with_attr("target", target))
                continue
            clone_gv = tvm.ir.GlobalVar(f"{fname}_{target.kind.name}{k}")
            new[clone_gv] = func.with_attr("target", target)
            for d in kdevs:
                rename[(fname, d)] = clone_gv
    if rename:
        new.update_func(new.get_global_var("main"), _rebuild_main(new["main"], rename, dev))
    return new


def _schedule_gpu(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """dlight-schedule every GPU PrimFunc; refuse one that stays unscheduled."""
    import tvm.s_tir.dlight as dl

    gpu = {gv: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)
           and "target" in f.attrs and f.attrs["target"].kind.name != "llvm"
           and f.attrs["target"].kind.name != "c"}
    if not gpu:
        return mod
    ctx.log(f"scheduling {len(gpu)} GPU functions with dlight")
    new = mod.clone()
    by_target: dict[str, dict] = {}
    for gv, f in gpu.items():
        by_target.setdefault(str(f.attrs["target"]), {})[gv] = f
    for funcs in by_target.values():
        target = next(iter(funcs.values())).attrs["target"]
        sub = tvm.IRModule(funcs)
        with target:
            sub = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                          dl.gpu.GeneralReduction(), dl.gpu.Fallback())(sub)
        for gv, f in sub.functions_items():
            new.update_func(new.get_global_var(gv.name_hint), f)
    unscheduled = sorted(gv.name_hint for gv, f in new.functions_items()
                         if gv.name_hint in {g.name_hint for g in gpu}
                         and not bool(f.attrs.get("tirx.is_scheduled", False)))
    if unscheduled:
        raise BuildError(f"GPU PrimFuncs left unscheduled by dlight: {unscheduled}; place "
                         f"these ops on a CPU device (Placement.rules / overrides)")
    return new


def lower(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Legalize and fuse ``mod``; every PrimFunc gets its device's target; then scheduled:
    tuned schedules from ``ctx.tuning_db`` first, the default CPU schedule for the other CPU
    kernels (``HGRT_DEFAULT_SCHEDULE=0`` turns it off), dlight for the other GPU kernels.
    With ``ctx.schedule`` False the fused, unscheduled module is returned (what is tuned)."""
    target = ctx.devices[0].target
    with target, tvm.transform.PassContext(opt_level=3):
        for p in _lowering_passes():
            mod = p(mod)
    mod = _assign_targets(mod, ctx)
    n = sum(1 for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc))
    ctx.log(f"lowered to {n} PrimFuncs")
    if not ctx.schedule:
        return mod
    if ctx.tuning_db:
        from hgrt.tune import apply_database

        mod, ctx.tuning = apply_database(mod, ctx.tuning_db, use_verdicts=ctx.tuning_verdicts)
        ctx.log(ctx.tuning.summary())
    if os.environ.get("HGRT_DEFAULT_SCHEDULE", "1") != "0":
        from hgrt.relay_passes.schedule_cpu import schedule_cpu_functions

        mod, ctx.cpu_schedule = schedule_cpu_functions(mod)
        ctx.log(ctx.cpu_schedule.summary())
    return _schedule_gpu(mod, ctx)


def build_library(mod: tvm.IRModule, ctx: BuildContext) -> tvm.runtime.Module:
    """One ``tvm.tirx.build`` over every PrimFunc, each for its own target → one module."""
    funcs = {}
    for gv, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc):
            funcs[gv] = f.with_attr("global_symbol", gv.name_hint)
    if not funcs:
        raise BuildError("the model lowered to no kernels; nothing to build")
    ctx.log(f"building {len(funcs)} PrimFuncs into one library")
    try:
        return tvm.tirx.build(tvm.IRModule(funcs))
    except Exception as e:
        raise BuildError(f"tvm.tirx.build failed: {e}") from e

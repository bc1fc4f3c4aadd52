"""The lowering passes: Relax ops → ``R.call_tir`` into fused PrimFuncs, each with the target
of its device, scheduled, built into one library.

``legalize_and_fuse`` lets TVM do the work (``lowering_passes``); fusion never crosses devices
because every crossing edge is an ``R.to_vdevice`` (not a call_tir). What TVM 0.27 gets wrong
``assign_targets`` repairs from the dataflow, not from the vdevice annotations: a call's device
is the device of its tensor operands (LegalizeOps drops the vdevice of conv / batch_norm
outputs), and each PrimFunc's ``target`` attr is set from the device of its call sites (FuseTIR
drops it). ``schedule_gpu`` schedules GPU PrimFuncs with dlight; one left unscheduled is a
``BuildError`` naming it. ``build_library`` compiles every PrimFunc into one module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from hgrt.errors import BuildError
from hgrt.graph import ELEMWISE_MAX, OPAQUE
from hgrt.relay_passes.context import BuildContext
from hgrt.relay_passes.pipeline import contract, located
from hgrt.relay_passes.relax_util import (
    CALL_TIR,
    TO_VDEVICE,
    alone,
    bindings,
    copied_in,
    func_target,
    is_scheduled,
    op_name,
    prim_funcs,
    site,
    tensor_args,
)

# ops that survive lowering and run as views of their input (RewriteDataflowReshape)
VIEW_OPS = ("relax.reshape",)


def lowering_passes() -> list[tvm.transform.Pass]:
    """TVM's passes that legalize and fuse a placed module (what ``legalize_and_fuse`` runs)."""
    return [
        # inference batch_norm (one fold_batch_norm left: statistics not weights) →
        # elementwise ops that fuse into the convolution before it
        relax.transform.DecomposeOpsForInference("main"),
        relax.transform.CanonicalizeBindings(),  # (y, mean, var)[0] → y: relu may fuse too
        # reshape(reshape(x, a), b) -> reshape(x, b): two reshapes in a row fuse into one
        # copying kernel that RewriteDataflowReshape does not see as a view (squeezenet's
        # mean, kept N,C,1,1, then flattened: 28 us a run for 4 KB); one becomes a view
        relax.transform.RemoveRedundantReshape(),
        relax.transform.DeadCodeElimination(["main"]),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        keep_device_joins_apart,
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.AnnotateTIROpPattern(),  # the fused kernels' kinds: graph "op_pattern"
        relax.transform.DeadCodeElimination(["main"]),
        relax.transform.RewriteDataflowReshape(),  # reshape kernels → views (graph "__nop")
        reshape_outputs_as_views,
        # the kernels that became views (here and above): not built, not counted as untuned
        # by a tuning report (resnet50's flatten)
        relax.transform.DeadCodeElimination(["main"]),
    ]


@tvm.transform.module_pass(opt_level=0, name="hgrt.ReshapeOutputsAsViews")
def reshape_outputs_as_views(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
    """A reshape kernel that RewriteDataflowReshape leaves because it makes an output of the
    dataflow block (squeezenet's last (1,1000) -> (1,1000,1,1), the model's output) becomes a
    view too: a graph output may be a view (the planner keeps its bytes to the end, the
    executor copies a viewed output out). Only such outputs, with TVM's own test (a reshape
    pattern, one tensor read) and one dtype and element count in and out; not when the bytes
    are an input's or a weight's (through views): ``set_input`` would change the output."""
    main = mod["main"]
    params = set(main.params)
    funcs = prim_funcs(mod)
    reshape = tvm.ir.Op.get("relax.reshape")
    viewed: dict[relax.Var, relax.Expr] = {}  # a view's input, to find whose bytes it is
    swap: dict[relax.Var, relax.Expr] = {}

    def root(v: relax.Expr) -> relax.Expr:
        while isinstance(v, relax.Var) and v in viewed:
            v = viewed[v]
        return v

    def numel(ty: relax.Type) -> int | None:
        values = getattr(getattr(ty, "shape", None), "values", None)
        dims = [getattr(d, "value", None) for d in values] if values is not None else [None]
        return None if None in dims else int(np.prod(dims, dtype=np.int64))

    for b in bindings(main):
        call = b.value
        if isinstance(call, relax.Call) and call.op.same_as(reshape):
            viewed[b.var] = call.args[0]
            continue
        if (isinstance(b.var, relax.DataflowVar) or op_name(call) != CALL_TIR
                or not isinstance(call.args[0], tvm.ir.GlobalVar)):
            continue
        func = funcs.get(call.args[0].name_hint)
        args = list(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else []
        if (func is None or len(args) != 1 or len(func.params) != 2
                or not isinstance(args[0], relax.Var) or root(args[0]) in params
                or not isinstance(b.var.ty, relax.TensorType)
                or not isinstance(args[0].ty, relax.TensorType)
                or str(b.var.ty.dtype) != str(args[0].ty.dtype)
                or numel(b.var.ty) is None or numel(b.var.ty) != numel(args[0].ty)
                or not relax.analysis.has_reshape_pattern(func)):
            continue
        swap[b.var] = relax.op.reshape(args[0], b.var.ty.shape)
    if not swap:
        return mod

    out = mod.clone()
    out["main"] = rebound(mod, main, swap)
    return out  # the kernels it leaves unused go in lowering_passes' last DCE


def rebound(mod: tvm.IRModule, func: relax.Function,
            values: dict[relax.Var, relax.Expr]) -> relax.Function:
    """``func`` with each variable of ``values`` bound to its new value instead."""

    @relax.expr_functor.mutator
    class _Swap(relax.PyExprMutator):
        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            if binding.var in values:
                value = self.builder_.normalize(values[binding.var])
                self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            else:
                super().visit_var_binding_(binding)

    return _Swap(mod).visit_expr(func)


@tvm.transform.module_pass(opt_level=0, name="hgrt.KeepDeviceJoinsApart")
def keep_device_joins_apart(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
    """An elementwise op reading a tensor copied from another device stays a kernel of its own:
    fused into the kernel that makes its other operand (the last matmul of one branch), it
    would make that kernel wait for the other device, and the two devices could not overlap.
    Each such call gets a private copy of its PrimFunc marked opaque (the PrimFunc may be
    shared with calls that should still fuse)."""
    main = mod["main"]
    copied = copied_in(main)
    computed = {b.var for b in bindings(main) if op_name(b.value) == CALL_TIR}
    funcs = prim_funcs(mod)
    joins: dict[relax.Var, relax.Call] = {}
    for b in bindings(main):
        call = b.value
        if op_name(call) != CALL_TIR or not isinstance(call.args[0], tvm.ir.GlobalVar):
            continue
        func = funcs.get(call.args[0].name_hint)
        args = [a for a in call.args[1].fields if isinstance(a, relax.Var)]
        if (func is None or not any(a in copied for a in args)
                or not any(a in computed for a in args)  # else nothing to fuse into
                or int(func.attrs.get("op_pattern", OPAQUE)) > ELEMWISE_MAX):
            continue
        joins[b.var] = call
    if not joins:
        return mod
    bb = relax.BlockBuilder(mod)
    replaced = {}
    for var, call in joins.items():
        func = funcs[call.args[0].name_hint].with_attr("op_pattern", OPAQUE)
        gv = bb.add_func(func, f"{call.args[0].name_hint}_join")
        replaced[var] = relax.Call(call.op, [gv, *call.args[1:]], call.attrs, call.ty_args)

    out = bb.get()
    out["main"] = rebound(out, main, replaced)
    return out


# after the passes that rewrite Relax ops (they match the ops lowering replaces) and after
# insert_copies, whose R.to_vdevice on every crossing edge keeps fusion within a device
@contract(reads={"devices"}, after=("insert_copies", "split_concat", "claim_onednn",
                                     "fold_batch_norm", "claim_affine"))
def legalize_and_fuse(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """``lowering_passes`` under the first device's target; a failure names the op it fails
    on."""
    with located(lambda: _failing_op(mod, ctx)):
        return _lowered(mod, ctx)


def _lowered(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    with ctx.devices[0].target, tvm.transform.PassContext(opt_level=3):
        for p in lowering_passes():
            mod = p(mod)
    return mod


def _failing_op(mod: tvm.IRModule, ctx: BuildContext) -> str:
    """The first op binding of ``main`` that lowering fails on alone."""
    for b in bindings(mod["main"]):
        if op_name(b.value) in (None, TO_VDEVICE):
            continue
        try:
            _lowered(alone(b.value, mod), ctx)
        except Exception:
            return site(b, ctx, ctx.device_of_vdevice(getattr(b.var.ty, "vdevice", None)))
    return "no op fails alone (a fusion of several does)"


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


# GPU functions are known by their target; the tuned ones are scheduled already
@contract(after=("assign_targets", "apply_tuning"))
def schedule_gpu(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """dlight-schedule every GPU PrimFunc not scheduled yet; refuse one that stays unscheduled.
    Uses nothing of ``ctx`` but its log."""
    import tvm.s_tir.dlight as dl

    gpu = {name: f for name, f in prim_funcs(mod).items()
           if func_target(f) is not None and f.attrs["target"].kind.name not in ("llvm", "c")}
    if not gpu:
        return mod
    ctx.log(f"scheduling {len(gpu)} GPU functions with dlight")
    new = mod.clone()
    by_target: dict[str, dict] = {}
    for name, f in gpu.items():
        by_target.setdefault(str(f.attrs["target"]), {})[name] = f
    rules = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                    dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    for funcs in by_target.values():
        with next(iter(funcs.values())).attrs["target"], located(
                functools.partial(_failing_kernel, mod, ctx, funcs, rules)):
            sub = rules(tvm.IRModule(funcs))
        for gv, f in sub.functions_items():
            new.update_func(new.get_global_var(gv.name_hint), f)
    unscheduled = [_kernel_site(mod, ctx, n) for n in sorted(gpu) if not is_scheduled(new[n])]
    if unscheduled:
        raise BuildError(f"GPU PrimFuncs left unscheduled by dlight: {unscheduled}; place "
                         f"these ops on a CPU device (Placement.rules / overrides)")
    return new


@contract(reads={"devices"}, writes={"lowered"}, after=("schedule_cpu", "schedule_gpu"))
def build_library(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """One ``tvm.tirx.build`` over every PrimFunc, each for its own target → one module, in
    ``ctx.lowered.lib``; the IR goes on untouched (to graph_codegen). ``ctx.devices``: the
    host target of a library without kernels."""
    funcs = {name: f.with_attr("global_symbol", name) for name, f in prim_funcs(mod).items()}
    # no kernels (outputs are inputs or weights, rearranged): an empty host library
    host = None if funcs else _host_target(ctx)
    ctx.log(f"building {len(funcs)} PrimFuncs into one library")
    with located(functools.partial(_failing_kernel, mod, ctx, funcs, tvm.tirx.build)):
        ctx.lowered.lib = tvm.tirx.build(tvm.IRModule(funcs), target=host)
    return mod


def _kernel_site(mod: tvm.IRModule, ctx: BuildContext, name: str) -> str:
    """PrimFunc ``name`` as the first binding of ``main`` that calls it, with its device."""
    main = mod["main"]
    calls = [b for b in bindings(main)
             if op_name(b.value) == CALL_TIR and b.value.args[0].name_hint == name]
    return site(calls[0], ctx, binding_devices(main, ctx).get(calls[0].var)) if calls \
        else f"kernel {name!r}"


def _failing_kernel(mod: tvm.IRModule, ctx: BuildContext, funcs: dict,
                    attempt: Callable[[tvm.IRModule], object]) -> str:
    """The first PrimFunc of ``funcs`` that ``attempt`` fails on alone, as ``_kernel_site``."""
    for name, f in funcs.items():
        try:
            attempt(tvm.IRModule({name: f}))
        except Exception:
            return _kernel_site(mod, ctx, name)
    return "no kernel fails alone"


def _host_target(ctx: BuildContext) -> tvm.target.Target:
    """The CPU target of the build: its first CPU device's, else the host of device 0's."""
    cpus = [d.target for d in ctx.devices if not d.is_gpu]
    first = ctx.devices[0].target
    return cpus[0] if cpus else (first.host or tvm.target.Target("llvm"))

"""The rewrites of hgrt's own that ``legalize_and_fuse`` runs among TVM's lowering passes
(``lowering_passes``): TVM's reshape views with their readers kept connected, a reshape kernel
that makes a graph output becomes a view, and an elementwise op joining two devices' branches
stays a kernel of its own; and ``powers_as_products``, run before them.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from hgrt.graph import ELEMWISE_MAX, OPAQUE
from hgrt.relay_passes.util.relax_util import (
    CALL_TIR,
    MainReader,
    bindings,
    copied_in,
    op_name,
    prim_funcs,
)


@tvm.transform.module_pass(opt_level=0, name="hgrt.RewriteDataflowReshape")
def rewrite_dataflow_reshape(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
    """TVM's RewriteDataflowReshape (reshape kernels become ``R.reshape``, views), with the
    readers of each rewritten variable reconnected: where the reshape's type differs from the
    kernel's (an identity ``nn.pad`` whose output type has no vdevice, of a tensor that has
    one), TVM binds a new variable but leaves the readers on the old, now undefined one
    (MobileNetV2's zero pads)."""
    before = mod["main"]
    mod = relax.transform.RewriteDataflowReshape()(mod)
    main = mod["main"]
    if not any(isinstance(v, relax.DataflowVar) for v in relax.analysis.free_vars(main)):
        return mod
    old, new = list(bindings(before)), list(bindings(main))
    assert len(old) == len(new), "RewriteDataflowReshape rewrites bindings one for one"
    renamed = {o.var: n.var for o, n in zip(old, new, strict=True) if not o.var.same_as(n.var)}

    @relax.expr_functor.mutator
    class _Reconnect(relax.PyExprMutator):
        def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
            return renamed.get(var, var)

    out = mod.clone()
    out["main"] = _Reconnect(mod).visit_expr(main)
    return out


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


# exponents a power of a constant becomes products (or a square root) for
POWERS = {2.0: "square", 3.0: "cube", 0.5: "sqrt", 1.0: "identity"}


def _power(x: relax.Expr, kind: str) -> relax.Expr:
    if kind == "square":
        return relax.op.multiply(x, x)
    if kind == "cube":
        return relax.op.multiply(relax.op.multiply(x, x), x)
    return relax.op.sqrt(x) if kind == "sqrt" else x


def powers_as_products(mod: tvm.IRModule, ctx) -> tvm.IRModule:
    """``power(x, c)`` with ``c`` a constant or weight of one value in ``POWERS`` becomes
    ``x * x`` (``x * x * x``, ``sqrt(x)``, ``x``): exact where ``powf`` is not. CUDA's fast math
    (TVM's default for nvcc) computes ``powf(x, 2)`` as ``exp2(2 * log2(x))``, NaN for every
    negative x: an RMSNorm's square (T5, Llama) made the whole output NaN on a GPU; on a CPU a
    product is also cheaper than libm's ``pow``."""
    main = mod["main"]
    if "num_input" not in (main.attrs or {}):
        return mod
    reader = MainReader(main, ctx)
    swap = {}
    for b in bindings(main):
        if op_name(b.value) != "relax.power" or len(b.value.args) != 2:
            continue
        x, e = b.value.args
        value = reader.value(e)
        if value is None or value.size != 1 or getattr(x.ty, "dtype", None) != str(value.dtype):
            continue
        kind = POWERS.get(float(value.reshape(())))
        if kind is None or not str(value.dtype).startswith("float"):
            continue
        swap[b.var] = _power(x, kind)
    if not swap:
        return mod
    out = mod.clone()
    out["main"] = rebound(mod, main, swap)
    return out

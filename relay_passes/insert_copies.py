"""insert_copies: rebuild ``main`` so that every op reads its operands on its own device.

- an operand made on another device is brought over with ``R.to_vdevice``, once per
  (tensor, destination device) however many consumers it has there, always from the tensor's
  home device (never a copy of a copy, so no ping-pong);
- weights live where they are used: a weight used on two devices becomes two function params,
  ``w`` on the first device that uses it and ``w@cpu:1`` on the next (``ctx.weights.source``
  maps each param back to its weight), so no weight is copied at run time;
- a user input lives on its hinted device, else on the device of its first consumer, and is
  copied once per other device that needs it;
- constants stay inline: they take the device of the op that reads them.

Params are renamed to C identifiers (TVM names kernel arguments after them); the names the
graph shows go to ``ctx.weights.graph_names``.

Reads ``ctx.placed`` and ``ctx.weights.values``; fills ``ctx.weights.source`` and
``ctx.weights.graph_names``.
"""

from __future__ import annotations

import tvm
from tvm import relax

from hgrt.errors import BuildError
from hgrt.relay_passes.util.context import BuildContext, param_identifier
from hgrt.relay_passes.util.pipeline import contract, located
from hgrt.relay_passes.util.relax_util import bindings, called, moved_to, site, static_dims

# calls that have no graph form, and why
_READ_SHAPE = ("the shape is data-dependent (read from {args} at run time) and hgrt plans "
               "memory at build time: give {args} as a constant or model initializer")
UNSUPPORTED = {
    "vm.builtin.tensor_to_shape": _READ_SHAPE,
    "relax.tensor_to_shape": _READ_SHAPE,  # (ONNX Slice with starts/ends as graph inputs)
    "If": "control flow: hgrt runs a fixed list of kernels; give the condition as a constant "
          "(then it folds) or run the model in the Relax VM",
}


def _vars_in(expr: relax.Expr, tuple_lits: dict[str, relax.Tuple]) -> list[str]:
    """Names of the tensor variables an argument reads (looking through tuple literals)."""
    if isinstance(expr, relax.Var):
        if expr.name not in tuple_lits:
            return [expr.name]
        expr = tuple_lits[expr.name]
    return [n for f in expr.fields for n in _vars_in(f, tuple_lits)] if isinstance(
        expr, relax.Tuple) else []


class _Rebuilder:
    """Holds, for each original variable, its home device and its version on each device."""

    def __init__(self, ctx: BuildContext, vdevices: list[relax.VDevice],
                 func: relax.Function) -> None:
        self.ctx = ctx
        self.vdevices = vdevices
        self.bb = relax.BlockBuilder()
        self.home: dict[str, int] = {}
        self.at: dict[tuple[str, int], relax.Expr] = {}
        self.alias: dict[str, str] = {}
        self.tuple_lits: dict[str, relax.Tuple] = {}
        self.containers: dict[str, relax.Expr] = {}  # tuples built for outputs
        self.consts: dict[str, relax.Expr] = {}
        self.var2val = relax.analysis.get_var2val(func)  # main's variable -> its value
        self.param_names = {p.name for p in func.params}

    def inputs_behind(self, exprs) -> list[str]:
        """The parameters of main whose values ``exprs`` are computed from."""
        found, seen, todo = set(), set(), list(exprs)
        while todo:
            e = todo.pop()
            if isinstance(e, relax.Var) and e.name not in seen:
                seen.add(e.name)
                if e.name in self.param_names:
                    found.add(e.name)
                elif e in self.var2val:
                    todo.append(self.var2val[e])
            elif isinstance(e, relax.Call) and getattr(e.op, "name", "") != "relax.shape_of":
                todo.extend(e.args)  # (a shape_of reads a shape, known, not values)
            elif isinstance(e, relax.Tuple):
                todo.extend(e.fields)
        return sorted(found)

    def canon(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    def _lookup(self, expr: relax.Expr, visit) -> tuple[relax.Expr | None, str | None]:
        """Tuples rebuilt field by field with ``visit``; non-variables, constants and tuple
        literals resolved: ``(expr, None)``. A variable holding device data: ``(None, name)``."""
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([visit(f) for f in expr.fields]), None
        if not isinstance(expr, relax.Var):
            return expr, None
        name = self.canon(expr.name)
        if name in self.consts:
            return self.consts[name], None
        if name in self.tuple_lits:
            return visit(self.tuple_lits[name]), None
        return None, name

    def on_device(self, expr: relax.Expr, dev: int) -> relax.Expr:
        """``expr`` as seen by an op on ``dev``: copies tensors over once, rebuilds tuples."""
        done, name = self._lookup(expr, lambda e: self.on_device(e, dev))
        if name is None:
            return done
        if (name, dev) in self.at:
            return self.at[(name, dev)]
        if name not in self.home:
            if name in self.containers:
                raise BuildError(f"{name!r} is a tuple made on several devices and read as a "
                                 f"whole by an op on {self.ctx.devices[dev].name}; unsupported")
            raise BuildError(f"variable {name!r} is used before it is defined")
        src = self.at[(name, self.home[name])]
        if not isinstance(src.ty, (relax.TensorType, relax.TupleType)):
            return src  # shapes and scalars are not device data: nothing to copy
        if isinstance(src.ty, relax.TupleType):
            fields = [self.bb.emit(relax.TupleGetItem(src, i)) for i in range(len(src.ty.fields))]
            copied = relax.Tuple([self.bb.emit(relax.op.to_vdevice(f, self.vdevices[dev]))
                                  for f in fields])
        else:
            copied = self.bb.emit(relax.op.to_vdevice(src, self.vdevices[dev]),
                                  name_hint=f"{name}_to_{dev}")
        self.at[(name, dev)] = copied
        return copied

    def on_home(self, expr: relax.Expr) -> relax.Expr:
        """``expr`` on the device that made it (no copy)."""
        done, name = self._lookup(expr, self.on_home)
        return done if name is None else self.at[(name, self.home[name])]

    def define(self, name: str, value: relax.Expr, dev: int) -> None:
        self.home[name] = dev
        self.at[(name, dev)] = value


def _param_devices(func: relax.Function, ctx: BuildContext) -> dict[str, list[int]]:
    """Devices that read each function param, in order of first use."""
    alias: dict[str, str] = {}
    tuple_lits: dict[str, relax.Tuple] = {}
    uses: dict[str, list[int]] = {p.name: [] for p in func.params}
    for b in bindings(func):
        value, name = b.value, b.var.name
        if isinstance(value, relax.Var):
            alias[name] = alias.get(value.name, value.name)
        elif isinstance(value, relax.Tuple):
            tuple_lits[name] = value
        elif (dev := ctx.placed.op_device.get(name, moved_to(value, ctx))) is not None:
            for v in (alias.get(v, v) for a in value.args for v in _vars_in(a, tuple_lits)):
                if v in uses and dev not in uses[v]:
                    uses[v].append(dev)
    return uses


@contract(reads={"devices", "placed", "weights"}, writes={"weights"}, after=("place_devices",))
def insert_copies(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Rebuild ``main`` with params on their devices and ``R.to_vdevice`` on crossing edges."""
    func = mod["main"]
    vdevices = list(mod.global_infos["vdevice"])
    rb = _Rebuilder(ctx, vdevices, func)
    uses = _param_devices(func, ctx)
    num_input = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs \
        else len([p for p in func.params if p.name not in ctx.weights.values])

    params: list[relax.Var] = []
    weights, input_device = ctx.weights, ctx.placed.input_device
    weights.source.clear()
    weights.graph_names.clear()
    for i, p in enumerate(func.params):
        if not isinstance(p.ty, relax.TensorType):
            raise BuildError(f"input {p.name!r} has type {p.ty}; hgrt takes tensor inputs only")
        is_weight = i >= num_input
        devs = (uses[p.name] or [input_device.get(p.name, 0)]) if is_weight else [
            input_device.get(p.name, (uses[p.name] or [0])[0])]
        for k, dev in enumerate(devs):
            pname = p.name if k == 0 else f"{p.name}@{ctx.devices[dev].name}"
            rname = param_identifier(pname, weights.graph_names)
            weights.graph_names[rname] = pname
            var = relax.Var(rname, relax.TensorType(p.ty.shape, p.ty.dtype, vdevices[dev]))
            params.append(var)
            if k == 0:
                rb.define(p.name, var, dev)
            else:
                rb.at[(p.name, dev)] = var
            if is_weight:
                weights.source[pname] = p.name

    bb = rb.bb
    with bb.function("main", params, attrs={"num_input": num_input}):
        with bb.dataflow():
            for b in bindings(func):
                with located(site(b, ctx, ctx.placed.op_device.get(b.var.name))):
                    _rebind(rb, b, ctx)
            out = bb.emit_output(rb.on_home(func.body.body))
        bb.emit_func_output(out)
    new_mod = mod.clone()
    new_mod.update_func(new_mod.get_global_var("main"), bb.finalize()["main"])
    n_copies = sum(1 for (n, d) in rb.at if rb.home.get(n) not in (None, d))
    ctx.log(f"inserted {n_copies} cross-device copies")
    return new_mod


def _rebind(rb: _Rebuilder, b: relax.VarBinding, ctx: BuildContext) -> None:
    name, value = b.var.name, b.value
    if not isinstance(b, relax.VarBinding):
        raise BuildError(
            f"binding {name!r} ({called(value)}) is a {type(b).__name__}: a shape that is "
            f"known only at run time (from an input's values or the data: axes, repeats or "
            f"limits given as graph inputs; NonZero, Unique, Compress); hgrt plans memory at "
            f"build time: give such inputs as constants or model initializers")
    if called(value) in UNSUPPORTED:
        _refuse(b, ctx)
    if isinstance(value, relax.Var):
        rb.alias[name] = rb.canon(value.name)
    elif isinstance(value, tvm.ir.expr.Constant):
        rb.consts[name] = value
    elif isinstance(value, relax.Tuple):
        rb.tuple_lits[name] = value
        rb.containers[name] = value
    elif isinstance(value, relax.TupleGetItem):
        src = value.tuple_value
        if isinstance(src, relax.Var) and rb.canon(src.name) in rb.tuple_lits:
            field = rb.tuple_lits[rb.canon(src.name)].fields[value.index]
            if isinstance(field, relax.Var):
                rb.alias[name] = rb.canon(field.name)
            else:
                rb.consts[name] = field
            return
        tname = rb.canon(src.name)
        dev = rb.home[tname]
        rb.define(name, rb.bb.emit(relax.TupleGetItem(rb.at[(tname, dev)], value.index),
                                   name_hint=name), dev)
    elif (dev := moved_to(value, ctx)) is not None:
        rb.define(name, rb.on_device(value.args[0], dev), dev)
    elif isinstance(value, relax.Call) and name in ctx.placed.op_device:
        if not _static(b.var.ty):
            read = rb.inputs_behind(value.args[1:]) or rb.inputs_behind(value.args)
            _refuse(b, ctx, f"its shape ({b.var.ty}) is known only at run time, from the "
                            f"values of {', '.join(map(repr, read))}; hgrt plans memory at "
                            f"build time: give such inputs as constants or model initializers")
        dev = ctx.placed.op_device[name]
        args = [rb.on_device(a, dev) for a in value.args]
        call = relax.Call(value.op, args, value.attrs, value.ty_args)
        rb.define(name, rb.bb.emit(call, name_hint=name), dev)
    else:
        _refuse(b, ctx)


def _static(ty: relax.Type) -> bool:
    """Whether every tensor of ``ty`` has a shape known at build time."""
    if isinstance(ty, relax.TupleType):
        return all(_static(f) for f in ty.fields)
    return not isinstance(ty, relax.TensorType) or static_dims(ty) is not None  # (or not planned)


def _refuse(b: relax.VarBinding, ctx: BuildContext, why: str | None = None) -> None:
    args = ", ".join(repr(a.name) for a in getattr(b.value, "args", ())
                     if isinstance(a, relax.Var))
    why = why or UNSUPPORTED.get(called(b.value), "not supported by hgrt (calls to Relax "
                                 "functions must be inlined first)")
    raise BuildError(f"{site(b, ctx)}: " + why.format(args=args))

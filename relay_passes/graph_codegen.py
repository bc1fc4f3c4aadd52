"""graph_codegen: a lowered Relax ``main`` → an hgrt ``Graph`` (before memory planning).

One node per function param (``op "null"``: user inputs first, then weights, then the constants
the lowering left inline, each on the device of the op that reads it), one ``tvm_op`` per
``R.call_tir`` (called as ``func(*args, *outputs)``), one ``__copy`` per ``R.to_vdevice`` and
one ``__nop`` per view (``R.reshape`` left by RewriteDataflowReshape), one ``__slice`` per
copy kernel that reads one aligned range of its input (``ctx.lowered.slices``), in
``overlap_order``
(the written order, unless a GPU is among the devices). Tuples and aliases only
rename entries. Every entry gets its static shape, dtype and device index; storage ids are one
per entry until ``plan_memory`` assigns them.

Reads ``ctx.devices``, ``ctx.weights`` (graph names, which params are weights) and
``ctx.lowered.why`` (each kernel's reasons: node attrs); adds the inline constants to
``ctx.weights``.
"""

from __future__ import annotations

import tvm
from tvm import relax

from hgrt.devices import cpu_requirements
from hgrt.errors import BuildError
from hgrt.graph import COPY_FUNC, NOP_FUNC, SLICE_FUNC, Graph, Node
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.lowered import VIEW_OPS, binding_devices
from hgrt.relay_passes.util.overlap_order import overlap_order
from hgrt.relay_passes.util.pipeline import contract, located
from hgrt.relay_passes.util.relax_util import (
    CALL_DPS_PACKED,
    CALL_TIR,
    TO_VDEVICE,
    bindings,
    callee,
    op_name,
    site,
    static_dims,
    tensor_args,
)

Entry = tuple[int, int, int]


def static_shape(ty: relax.Type, what: str) -> tuple[int, ...]:
    """The static shape of a tensor type, or a BuildError (hgrt plans memory at build time)."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise BuildError(f"{what}: type {ty} is not a tensor of known shape")
    dims = static_dims(ty)
    if dims is None:
        raise BuildError(f"{what}: shape {list(ty.shape.values)} is not static; give the "
                         f"input shapes (input_shapes=...) so every shape is known")
    return dims


def _tensor_types(ty: relax.Type) -> list[relax.TensorType]:
    if isinstance(ty, relax.TupleType):
        return [t for f in ty.fields for t in _tensor_types(f)]
    return [ty]


class _GraphBuilder:
    def __init__(self, ctx: BuildContext) -> None:
        self.ctx = ctx
        self.patterns: dict[str, str] = {}  # kernel -> TVM's op pattern kind (0-8)
        self.nodes: list[Node] = []
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[str] = []
        self.devices: list[int] = []
        self.row_ptr = [0]
        self.entries: dict[relax.Var, list[Entry]] = {}  # keyed by var: names repeat
        self.consts: list[tuple[relax.Expr, int, Entry]] = []
        self.const_nodes: list[int] = []
        self.outputs: set[relax.Var] = set()  # the variables that are graph outputs

    def add(self, node: Node, outputs: list[tuple[tuple[int, ...], str]], dev: int) -> list[Entry]:
        nid = len(self.nodes)
        self.nodes.append(node)
        for shape, dtype in outputs:
            self.shapes.append(shape)
            self.dtypes.append(dtype)
            self.devices.append(dev)
        self.row_ptr.append(self.row_ptr[-1] + len(outputs))
        return [(nid, i, 0) for i in range(len(outputs))]

    def const_entry(self, const: relax.Expr, dev: int) -> Entry:
        for c, d, entry in self.consts:
            if d == dev and c.same_as(const):
                return entry
        weights = self.ctx.weights
        name = weights.free_name(f"const_{len(self.consts)}", weights.values.keys())
        value = const.value.numpy()
        weights.values[name] = value
        weights.source[name] = name
        (entry,) = self.add(Node("null", name), [(tuple(value.shape), str(value.dtype))], dev)
        self.consts.append((const, dev, entry))
        self.const_nodes.append(entry[0])
        return entry

    def arg_entry(self, arg: relax.Expr, dev: int, where: str) -> Entry:
        if isinstance(arg, relax.Var):
            found = self.entries.get(arg)
            if found is None or len(found) != 1:
                raise BuildError(f"{where}: operand {arg.name!r} is not a single tensor")
            return found[0]
        if isinstance(arg, tvm.ir.expr.Constant):
            return self.const_entry(arg, dev)
        raise BuildError(f"{where}: operand {str(arg)[:60]!r} is neither a tensor nor a constant")

    def may_view(self, src: Entry, var: relax.Var) -> bool:
        """Whether ``var`` may be a view of entry ``src``: not where it is a graph output whose
        bytes are an input's or a weight's (through views): ``set_input`` would change it."""
        nid = src[0]
        while self.nodes[nid].func_name in (NOP_FUNC, SLICE_FUNC):
            nid = self.nodes[nid].inputs[0][0]
        return var not in self.outputs or self.nodes[nid].op != "null"

    def flatten(self, expr: relax.Expr, where: str) -> list[Entry]:
        if isinstance(expr, relax.Tuple):
            return [e for f in expr.fields for e in self.flatten(f, where)]
        if isinstance(expr, relax.Var):
            return list(self.entries[expr])
        if isinstance(expr, tvm.ir.expr.Constant):
            return [self.const_entry(expr, 0)]
        raise BuildError(f"{where}: {str(expr)[:60]!r} is not a tensor")


# the last pass on Relax: the graph's kernels are the library's functions
@contract(reads={"devices", "weights", "lowered"}, writes={"weights"},
          after=("build_library",))
def graph_codegen(mod: tvm.IRModule, ctx: BuildContext) -> Graph:
    """Translate the lowered ``main`` of ``mod`` into a Graph (storage ids not yet planned)."""
    func = mod["main"]
    dev = binding_devices(func, ctx)
    g = _GraphBuilder(ctx)
    g.patterns = {gv.name_hint: str(int(f.attrs["op_pattern"])) for gv, f in mod.functions.items()
                  if not isinstance(f, relax.Function) and f.attrs and "op_pattern" in f.attrs}
    g.outputs = _output_vars(func)
    args = []
    for p in func.params:
        shape = static_shape(p.ty, f"input {p.name!r}")
        name = ctx.weights.graph_names.get(p.name, p.name)
        g.entries[p] = g.add(Node("null", name), [(shape, str(p.ty.dtype))], dev[p])
        args.append(len(g.nodes) - 1)
    for b in overlap_order(list(bindings(func)), dev, ctx):
        with located(site(b, ctx, dev.get(b.var))):
            _emit(g, b, dev)
    heads = g.flatten(func.body.body, "output")
    weights = [n for n in args if g.nodes[n].name in ctx.weights.source]
    inputs = [n for n in args if n not in weights]
    return Graph(nodes=g.nodes, arg_nodes=inputs + weights + g.const_nodes,
                 node_row_ptr=g.row_ptr, heads=heads, shapes=g.shapes, dtypes=g.dtypes,
                 storage_ids=list(range(g.row_ptr[-1])), device_index=g.devices,
                 params=[g.nodes[i].name for i in weights + g.const_nodes],
                 device_names=[d.name for d in ctx.devices],
                 cpu_needs=[cpu_requirements(d.target) for d in ctx.devices])


def _output_vars(func: relax.Function) -> set[relax.Var]:
    """The variables of ``func`` whose values are its outputs (through tuples and aliases)."""
    out: set[relax.Var] = set()

    def take(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Tuple):
            for f in expr.fields:
                take(f)
        elif isinstance(expr, relax.Var):
            out.add(expr)

    take(func.body.body)
    for b in reversed(list(bindings(func))):
        if b.var in out and isinstance(b.value, (relax.Var, relax.Tuple)):
            take(b.value)
    return out


def _emit(g: _GraphBuilder, b: relax.VarBinding, dev: dict[relax.Var, int]) -> None:
    var, name, value = b.var, b.var.name, b.value
    op = op_name(value)
    if isinstance(value, relax.Var):
        g.entries[var] = g.entries[value]
    elif isinstance(value, relax.Tuple):
        g.entries[var] = g.flatten(value, name)
    elif isinstance(value, relax.TupleGetItem):
        g.entries[var] = [g.entries[value.tuple_value][value.index]]
    elif isinstance(value, tvm.ir.expr.Constant):
        g.entries[var] = [g.const_entry(value, dev.get(var, 0))]
    elif op in (CALL_TIR, CALL_DPS_PACKED):  # a kernel of the library, or a global function
        if len(value.args) > 2:
            raise BuildError(f"binding {name!r}: call_tir with symbolic shape arguments; hgrt "
                             f"needs static shapes")
        d = dev[var]
        ins = [g.arg_entry(a, d, name) for a in tensor_args(value)]
        outs = [(static_shape(t, f"binding {name!r}"), str(t.dtype))
                for t in _tensor_types(value.ty_args[0])]
        if var in g.ctx.lowered.slices and g.may_view(ins[0], var):
            g.entries[var] = g.add(Node("tvm_op", name, ins, {
                "func_name": SLICE_FUNC, "num_inputs": "1", "num_outputs": "1",
                "flatten_data": "0", "byte_offset": str(g.ctx.lowered.slices[var])}), outs, d)
            return
        func_name, extra = callee(value)
        attrs = {"func_name": func_name, "num_inputs": str(len(ins)),
                 "num_outputs": str(len(outs)), "flatten_data": "0",
                 **g.ctx.lowered.why.get(var, {}), **extra}
        if func_name in g.patterns:
            attrs["op_pattern"] = g.patterns[func_name]
        g.entries[var] = g.add(Node("tvm_op", name, ins, attrs), outs, d)
    elif op in (TO_VDEVICE, *VIEW_OPS):
        func_name = COPY_FUNC if op == TO_VDEVICE else NOP_FUNC
        d = dev[var]
        src = g.arg_entry(value.args[0], d if op != TO_VDEVICE else 0, name)
        attrs = {"func_name": func_name, "num_inputs": "1", "num_outputs": "1", "flatten_data": "0"}
        out = (static_shape(b.var.ty, f"binding {name!r}"), str(b.var.ty.dtype))
        g.entries[var] = g.add(Node("tvm_op", name, [src], attrs), [out], d)
    else:
        raise BuildError(f"binding {name!r}: {op or type(value).__name__} has no graph-executor "
                         f"form (expected call_tir, to_vdevice, tuples)")

"""simplify: rewrites of the imported model that make it cheaper (``import_model`` runs them,
so placement rules and node names see the rewritten graph).

A reduction over a stack of broadcasts, ``R.sum(R.stack([R.broadcast_to(a, S),
  R.broadcast_to(b, S)]), axis=0)``, is how TVM's ONNX frontend imports ``Sum`` / ``Mean`` /
  ``Max`` / ``Min`` with static shapes (resnet50's residual adds). It materialises the stack
  and keeps the add apart from the ``relu`` after it. It becomes the pairwise op
  (``a + b``, ``maximum``, ``minimum``; ``Mean`` divided by n), broadcast to ``S`` only if
the operands do not already have that shape, so FuseOps fuses it like any elementwise op.
The result is the same sum in another order (floating point sums of two or three terms).

Computations on weights alone (resnet50's ``transpose`` of its last Gemm's weight, 4 ms a run
on 2 cores) are done once at build time: ``relax.transform.LiftTransformParams`` splits them
into ``main_transform_params``, which is compiled and run here on the CPU, and ``main`` takes
their results as its weights (``fold_weight_transforms``). A model that places itself
(vdevices, ``R.to_vdevice``) has its transform run on this one CPU all the same; each result
keeps, as a parameter of ``main``, the device the model gave it.

An inference ``dropout`` passes its input through: the reads of its result
(``R.nn.dropout(x)[0]``) read ``x`` itself, and the dropout goes where nothing reads its mask.
A dropout between ops hid them from the passes that match them: squeezenet's last concat is
read by a convolution through one, which ``split_concat`` then takes like the others.

A unary element-wise op (ReLU, clip, sigmoid, ...) of a concat that nothing else reads
becomes the concat of the op of each part: ``relu(concat([a, b]))`` is
``concat([relu(a), relu(b)])``, the same numbers. FuseOps then fuses each op into its part's
kernel, and the concat, plain, is written in place by them (``concat_views``): ShuffleNet's
three stride-2 units (a pool and a convolution, concatenated, then ReLU). The op's binding
then holds the concat, the parts' ops are ``<concat>_<op><k>`` (what a placement override
names). Not where a dataflow variable would leave its block (a Relax module's concat read in
a later block).

(Inference ``batch_norm`` is left to after placement, so that a rule naming ``nn.batch_norm``
still places it: ``fold_batch_norm`` makes it a per-channel multiply and add, or lowering
decomposes it; either fuses into the convolution before it.)
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from hgrt.relay_passes.util.relax_util import HINT_ON_DEVICE, TO_VDEVICE, op_name

_log = logging.getLogger("hgrt.build")
TRANSFORM = "main_transform_params"  # the function LiftTransformParams makes
_PAIRWISE = {"relax.sum": relax.op.add, "relax.mean": relax.op.add,
             "relax.max": relax.op.maximum, "relax.min": relax.op.minimum}


def _axis_is_zero(call: relax.Call) -> bool:
    axis = call.attrs.axis
    return (axis is not None and len(axis) == 1 and int(axis[0]) == 0
            and not bool(call.attrs.keepdims))


@relax.expr_functor.mutator
class _StackedReductions(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, func: relax.Function) -> None:
        super().__init__(mod)
        self.var2val = relax.analysis.get_var2val(func)
        self.rewritten = 0
        # names of main's variables: the ops this emits take new ones (the builder's default
        # "lv" is the ONNX import's first name: two bindings named so were refused later)
        self.taken = {v.name for v in self.var2val} | {p.name for p in func.params}

    def _emit(self, expr: relax.Expr, base: str) -> relax.Var:
        """``expr`` bound before the binding being rewritten (which becomes an alias of the
        last), under a name main does not have."""
        k = 0
        while f"{base}{k}" in self.taken:
            k += 1
        self.taken.add(f"{base}{k}")
        return self.builder_.emit(self.builder_.normalize(expr), name_hint=f"{base}{k}")

    def _value(self, expr: relax.Expr) -> relax.Expr:
        return self.var2val.get(expr, expr) if isinstance(expr, relax.Var) else expr

    def _operands(self, call: relax.Call) -> list[relax.Expr] | None:
        if op_name(call) not in _PAIRWISE or not _axis_is_zero(call):
            return None
        stack = self._value(call.args[0])
        if op_name(stack) != "relax.stack" or int(stack.attrs.axis) != 0:
            return None
        items = self._value(stack.args[0])
        if not isinstance(items, relax.Tuple) or len(items.fields) < 2:
            return None
        out = []
        for item in items.fields:
            v = self._value(item)
            out.append(v.args[0] if op_name(v) == "relax.broadcast_to" else item)
        return out

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        operands = self._operands(call)
        if operands is None:
            return call
        op = _PAIRWISE[call.op.name]
        want = call.ty
        parts = [self.visit_expr(x) for x in operands]
        out = parts[0]
        for b in parts[1:]:
            out = self._emit(op(out, b), "pairwise")
        if call.op.name == "relax.mean":
            out = self._emit(relax.op.divide(out, relax.const(float(len(parts)), want.dtype)),
                             "pairwise")
        if not tvm_ffi.structural_equal(out.ty.shape, want.shape):
            out = self._emit(relax.op.broadcast_to(out, want.shape), "pairwise")
        self.rewritten += 1
        return out


def pairwise_reductions(mod: tvm.IRModule) -> tvm.IRModule:
    """Stacked reductions of ``main`` rewritten as pairwise ops (see module doc)."""
    return _rewrite_main(mod, lambda f: _StackedReductions(mod, f))


def _rewrite_main(mod: tvm.IRModule, make) -> tvm.IRModule:
    """``mod`` with ``main`` visited by the mutator ``make(main)`` (counting ``rewritten``),
    dead code gone; ``mod`` itself when nothing was rewritten."""
    func = mod["main"]
    m = make(func)
    new_func = m.visit_expr(func)
    if not m.rewritten:
        return mod
    mod = mod.clone()
    mod.update_func(mod.get_global_var("main"), new_func)
    return relax.transform.DeadCodeElimination(["main"])(mod)


@relax.expr_functor.mutator
class _Dropouts(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, var2val: dict) -> None:
        super().__init__(mod)
        self.var2val = var2val
        self.rewritten = 0

    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:
        source = op.tuple_value
        value = self.var2val.get(source) if isinstance(source, relax.Var) else source
        if (op.index == 0 and op_name(value) == "relax.nn.dropout"
                and not _escapes(source, value.args[:1])):
            self.rewritten += 1
            return self.visit_expr(value.args[0])
        return super().visit_tuple_getitem_(op)


def inference_dropouts(mod: tvm.IRModule) -> tvm.IRModule:
    """``main`` reading each inference dropout's input where it read its result (see module
    doc); the dropouts whose masks nothing reads are gone."""
    return _rewrite_main(mod, lambda f: _Dropouts(mod, relax.analysis.get_var2val(f)))


# element-wise ops of one tensor (their other arguments, if any, are attributes or scalars)
UNARY = frozenset({"relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh",
                   "relax.nn.silu", "relax.nn.gelu", "relax.exp", "relax.sqrt", "relax.abs",
                   "relax.negative"})


@relax.expr_functor.mutator
class _ThroughConcat(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, var2val: dict, reads: dict) -> None:
        super().__init__(mod)
        self.var2val, self.reads = var2val, reads
        self.names = {v.name for v in reads} | {v.name for v in var2val}
        self.rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        src = call.args[0] if op_name(call) in UNARY and call.args else None
        concat = self.var2val.get(src) if isinstance(src, relax.Var) else None
        parts = None if op_name(concat) != "relax.concat" else concat.args[0]
        parts = self.var2val.get(parts, parts) if isinstance(parts, relax.Var) else parts
        if (not isinstance(parts, relax.Tuple) or self.reads.get(src) != 1
                or any(isinstance(getattr(a, "ty", None), relax.TensorType)  # clip's bounds
                       for a in call.args[1:])  # are scalars; a tensor operand is no unary op
                or _escapes(src, parts.fields)):
            return super().visit_call_(call)
        short = call.op.name.rsplit(".", 1)[-1]
        mapped = [self.builder_.emit(relax.Call(call.op, [self.visit_expr(p), *call.args[1:]],
                                                call.attrs), self._name(f"{src.name}_{short}{k}"))
                  for k, p in enumerate(parts.fields)]
        self.rewritten += 1
        return self.builder_.normalize(relax.op.concat(mapped, axis=concat.attrs.axis))

    def _name(self, want: str) -> str:
        """``want``, or it with ``_`` appended until no variable of main has the name."""
        while want in self.names:
            want += "_"
        self.names.add(want)
        return want


def _escapes(var: relax.Expr, used: list) -> bool:
    """Whether reading ``used`` where ``var`` is read could take a dataflow variable out of its
    block: ``var`` leaves its block (a plain Var) while one of ``used`` may not."""
    return not isinstance(var, relax.DataflowVar) and any(
        isinstance(u, relax.DataflowVar) for u in used)


@relax.expr_functor.visitor
class _Reads(relax.PyExprVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.count: dict = {}

    def visit_var_(self, var: relax.Var) -> None:
        self.count[var] = self.count.get(var, 0) + 1

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> None:
        self.count[var] = self.count.get(var, 0) + 1


def _reads(func: relax.Function) -> dict:
    """How many times each variable of ``func`` is read (each occurrence in a binding's value,
    a branch of an ``If`` included, and in the function's result)."""
    r = _Reads()
    for blk in func.body.blocks:
        for b in blk.bindings:
            r.visit_expr(b.value)
    r.visit_expr(func.body.body)
    return r.count


def elementwise_through_concats(mod: tvm.IRModule) -> tvm.IRModule:
    """``main`` with unary element-wise ops of concats moved onto their parts (module doc)."""
    return _rewrite_main(mod, lambda f: _ThroughConcat(mod, relax.analysis.get_var2val(f),
                                                       _reads(f)))


def fold_weight_transforms(mod: tvm.IRModule, weights: dict[str, np.ndarray]
                           ) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Run the computations of ``main`` that read only weights once, now (see module doc).

    ``main`` must take its inputs first (``num_input`` attr), then the weights named in
    ``weights``. Returns the module whose ``main`` takes the computed tensors as weights, and
    the weights by its new parameter names. Nothing is compiled when nothing is computed.
    """
    main = mod["main"]
    n_in = int(main.attrs["num_input"])
    if len(main.params) == n_in:
        return mod, weights
    lifted = relax.transform.LiftTransformParams()(mod)
    transform = lifted[TRANSFORM]
    var2val = relax.analysis.get_var2val(transform)
    outs = transform.body.body
    outs = var2val.get(outs, outs) if isinstance(outs, relax.Var) else outs
    fields = list(outs.fields) if isinstance(outs, relax.Tuple) else [outs]
    args = [var2val.get(f, f) if isinstance(f, relax.Var) else f for f in fields]
    params = set(transform.params)
    new_main = lifted["main"]
    new_names = [p.name for p in new_main.params[n_in:]]
    if len(new_names) != len(args) or len(set(new_names)) != len(new_names) or any(
            not isinstance(p.ty, relax.TensorType) for p in new_main.params[n_in:]
    ) or not _well_formed(new_main):
        # symbolic shapes (a shape output comes first), clashing names, or an output that is
        # itself lifted (TVM 0.27 then returns an undefined var): leave the model as it is
        return mod, weights
    # every weight passes through unchanged (is a weight, not computed from weights)
    if all((a.tuple_value if isinstance(a, relax.TupleGetItem) else a) in params for a in args):
        return mod, weights
    # the transform may call the module's own functions (a Clip, a Pad): compile them along
    others = {gv: f for gv, f in lifted.functions_items() if gv.name_hint != "main"}
    try:
        values = _run_transform(tvm.IRModule(others),
                                [weights[p.name] for p in main.params[n_in:]])
    except Exception as e:  # only a saving: main then computes them, where a failure is named
        _log.info("weight-only computations left in main: %s", e)
        return mod, weights
    folded = dict(zip(new_names, values, strict=True))
    # every function but the transform stays: main calls kernels of its own (Clip, Pad, ...)
    kept = {gv: (new_main.with_attr("num_input", n_in) if gv.name_hint == "main" else f)
            for gv, f in lifted.functions_items() if gv.name_hint != TRANSFORM}
    return tvm.IRModule(kept, attrs=lifted.attrs, global_infos=lifted.global_infos), folded


def _well_formed(func: relax.Function) -> bool:
    try:
        relax.analysis.well_formed(func)  # TVM 0.27: raises on the first violation
    except Exception:
        return False
    return True


def _plain(ty: relax.Type) -> relax.Type:
    """``ty`` without its vdevice (tuples field by field)."""
    if isinstance(ty, relax.TupleType):
        return relax.TupleType([_plain(f) for f in ty.fields])
    return relax.TensorType(ty.shape, ty.dtype) if isinstance(ty, relax.TensorType) else ty


@relax.expr_functor.mutator
class _OneDevice(relax.PyExprMutator):
    """Drops ``R.to_vdevice`` / ``R.hint_on_device``; types are inferred again without them."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        return call.args[0] if op_name(call) in (TO_VDEVICE, HINT_ON_DEVICE) else call


def _on_one_device(func: relax.Function) -> relax.Function:
    """``func`` with every tensor on one device: a user-placed model's weight transform runs
    once, here, on the CPU; its results take their devices from ``main``'s parameters."""
    m = _OneDevice()
    params = [relax.Var(p.name, _plain(p.ty)) for p in func.params]
    for old, new in zip(func.params, params, strict=True):
        m.set_var_remap(old, new)
    return relax.Function(params, m.visit_expr(func.body), None, func.is_pure, func.attrs)


def _run_transform(mod: tvm.IRModule, args: list[np.ndarray]) -> list[np.ndarray]:
    """Compile ``mod`` (the lifted transform and the functions it calls) and run the
    transform on the CPU."""
    dev = tvm.cpu()
    mod = mod.clone()
    mod.update_func(mod.get_global_var(TRANSFORM), _on_one_device(mod[TRANSFORM]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(ex, dev)
    func = mod[TRANSFORM]
    tensors = [tvm.runtime.tensor(a, dev) for a in args]
    # LiftTransformParams takes the weights as one tuple parameter
    tuple_param = len(func.params) == 1 and isinstance(func.params[0].ty, relax.TupleType)
    out = vm[TRANSFORM](tensors) if tuple_param else vm[TRANSFORM](*tensors)
    items = out if isinstance(out, (list, tuple)) or not hasattr(out, "numpy") else [out]
    return [o.numpy() for o in items]

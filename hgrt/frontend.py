"""Model import: ONNX (ModelProto or path) or a Relax IRModule → (IRModule, params), with the
stacked reductions of TVM's ONNX import made pairwise and computations on weights alone done
once, here (``relay_passes/inner/simplify.py``), and the subgraphs that are one op (Clip, SiLU,
HardSwish, GELU, LayerNorm) made that op, whatever the exporter wrote
(``hgrt/importer/patterns.py``).

Params are always detached: ``main`` takes the user inputs first (``num_input`` of them), then
the weights, which come back as numpy arrays keyed by param name, so no weight is baked into
the compiled library. Small integer initializers (shapes, axes, positions) are the exception:
they become constants, so that TVM folds the shapes they give at import. An ONNX model is
prepared for TVM 0.27's import where that import is wrong (``_prepared``), its shape
arithmetic on static shapes folded and its nodes converted by ``hgrt.importer`` (hgrt's
converters first, then TVM's), and the warnings that import gives on every model hgrt hands it
are silenced.
"""

from __future__ import annotations

import contextlib
import io
import operator
import os
import re
import warnings
from typing import Any

import numpy as np
import tvm
from tvm import relax

from hgrt.errors import BuildError, HgrtError, did_you_mean
from hgrt.importer import fold_static_shapes, import_onnx, named_nodes, recognised_patterns
from hgrt.relay_passes.inner.simplify import (
    elementwise_through_concats,
    fold_weight_transforms,
    inference_dropouts,
    pairwise_reductions,
)
from hgrt.relay_passes.util.relax_util import static_dims

# what TVM's ONNX import says about every model hgrt gives it: the checker sees the weights that
# _from_onnx took out of the graph inputs
_BENIGN_WARNINGS = (r".* in initializer but not in graph input",)
SMALL_INTEGERS = 64  # integer initializers up to this size (shapes, axes, positions): constants


def is_weight(shape: tuple[int, ...] | list[int], dtype: Any) -> bool:
    """Whether a constant tensor is a weight (a param of ``main``, seen by the passes that use
    weights, stored in the weight pool) rather than a constant inlined into the kernels: one of
    one or more dimensions that is not a small integer tensor (a shape, axes, positions), in
    whatever form the model holds it (an ONNX initializer or ``Constant`` node, a constant
    bound in a Relax module)."""
    return len(shape) >= 1 and not (np.dtype(dtype).kind in "iub"
                                    and int(np.prod(shape)) <= SMALL_INTEGERS)


def _prepared(model: Any) -> Any:
    """A copy of ``model`` as TVM's ONNX import needs it (see the comments below)."""
    from onnx import helper, numpy_helper

    model, original = type(model)(), model
    model.CopyFrom(original)
    graph = model.graph
    named_nodes(model)  # so that an error can name the node
    inits = {t.name: t for t in graph.initializer}
    # old exporters list initializers as inputs too; TVM's frontend then makes each weight
    # two params, so keep only the true inputs
    kept = [i for i in graph.input if i.name not in inits]
    del graph.input[:]
    graph.input.extend(kept)
    # with params kept as inputs TVM needs shapes, axes and positions as constants to fold them
    small = [t for t in graph.initializer if np.prod(t.dims) <= SMALL_INTEGERS
             and np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).kind in "iub"]
    for t in reversed(small):
        graph.node.insert(0, helper.make_node("Constant", [], [t.name], value=t))
        graph.initializer.remove(t)
    _constant_nodes_as_initializers(graph)
    _sequence_insert_positions(graph, {t.name: numpy_helper.to_array(t) for t in small})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 99)
    if opset < 7:
        _channel_prelu(model, inits)
    return model


def _constant_nodes_as_initializers(graph: Any) -> None:
    """A ``Constant`` node that holds a weight (``is_weight``: biases as some exporters write
    them) becomes an initializer, so that it reaches the passes as an initializer would."""
    from onnx import helper

    outputs = {o.name for o in graph.output}
    for node in list(graph.node):
        if node.op_type != "Constant" or len(node.attribute) != 1 \
                or node.attribute[0].name != "value" or node.output[0] in outputs:
            continue
        t = node.attribute[0].t
        if is_weight(list(t.dims), helper.tensor_dtype_to_np_dtype(t.data_type)):
            tensor = type(t)()
            tensor.CopyFrom(t)
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
            graph.node.remove(node)


def _sequence_insert_positions(graph: Any, constants: dict[str, np.ndarray]) -> None:
    """TVM inserts at ``n + p + 1`` for a negative position ``p``, ONNX at ``n + p``: give TVM
    ``p - 1``."""
    from onnx import helper

    for node in list(graph.node):
        p = constants.get(node.input[2]) if node.op_type == "SequenceInsert" and len(
            node.input) == 3 else None
        if p is not None and int(p) < 0:
            name = f"{node.input[2]}_for_{node.output[0]}"
            graph.node.insert(0, helper.make_node("Constant", [], [name], value=helper.make_tensor(
                name, helper.np_dtype_to_tensor_dtype(p.dtype), p.shape, [int(p) - 1])))
            node.input[2] = name


def _channel_prelu(model: Any, inits: dict) -> None:
    """Before opset 7 a 1-D PRelu slope is per channel (axis 1); TVM reads it numpy-style
    (last axis): shape it (C, 1, ...) so that it broadcasts onto axis 1."""
    from onnx import shape_inference

    graph = model.graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim)
             for v in [*graph.input, *shape_inference.infer_shapes(model).graph.value_info]}
    for node in graph.node:
        if node.op_type != "PRelu" or node.input[1] not in inits:
            continue
        slope, rank = inits[node.input[1]], ranks.get(node.input[0], 0)
        if len(slope.dims) == 1 and slope.dims[0] > 1 and rank > 2:
            slope.dims.extend([1] * (rank - 2))


def _checked_shapes(model: Any, input_shapes: dict[str, Any] | None) -> dict[str, list[int]]:
    """``input_shapes`` checked against the model's graph inputs: a name it lacks was ignored,
    and a -1 or a rank other than the model's failed late or not at all."""
    if not input_shapes:
        return {}
    if not isinstance(input_shapes, dict):
        raise BuildError(f"input_shapes must map input names to shapes, got "
                         f"{type(input_shapes).__name__}")
    inits = {t.name for t in model.graph.initializer}
    declared = {v.name: v for v in model.graph.input if v.name not in inits}
    out = {}
    for name, shape in input_shapes.items():
        if name in inits:
            raise BuildError(f"input_shapes: {name!r} is an initializer (a weight), not an "
                             f"input; inputs: {list(declared)}")
        if name not in declared:
            raise BuildError(f"input_shapes: input {did_you_mean(name, list(declared))}")
        try:
            dims = [operator.index(d) for d in shape]
        except TypeError:
            dims = None
        if dims is None or any(d < 0 for d in dims):
            raise BuildError(f"input_shapes[{name!r}] = {shape!r}: give a list of sizes >= 0")
        model_dims = declared[name].type.tensor_type.shape.dim  # (fixed ones may change:
        if declared[name].type.tensor_type.HasField("shape") \
                and len(model_dims) != len(dims):  # a model exported at batch 1, built at 4)
            raise BuildError(f"input_shapes[{name!r}] = {dims}: the model's input has rank "
                             f"{len(model_dims)}")
        out[name] = dims
    return out


def _from_onnx(model: Any, input_shapes: dict[str, Any] | None) -> tuple[tvm.IRModule, dict]:
    import onnx

    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(os.fspath(model))
    shape_dict = _checked_shapes(model, input_shapes)
    printed = io.StringIO()  # TVM prints "Error converting operator X, ..." before it raises
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            for message in _BENIGN_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            # the model's own input names, as onnxruntime takes them: TVM's identifiers
            # ("x.1" -> "x_1") would let set_input("x_1") write another input of a model that
            # has both
            mod = import_onnx(_prepared(fold_static_shapes(model, shape_dict)),
                              shape_dict or None)
    except HgrtError:
        raise
    except Exception as e:
        op = re.search(r"converting operator (\w+)", printed.getvalue())
        raise BuildError(f"the ONNX frontend cannot import this model"
                         f"{f' (operator {op[1]})' if op else ''}: {e}") from e
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    num_input = int(main.attrs["num_input"]) if "num_input" in main.attrs else len(main.params)
    names = [p.name for p in main.params[num_input:]]
    return mod, {n: v.numpy() for n, v in zip(names, detached.get("main", []), strict=True)}


@relax.expr_functor.mutator
class _LiftConstants(relax.PyExprMutator):
    """Each weight (``is_weight``) bound as a constant in ``main`` becomes a new parameter."""

    def __init__(self, mod: tvm.IRModule, taken: set[str]) -> None:
        super().__init__(mod)
        self.taken = taken
        self.lifted: list[tuple[relax.Var, np.ndarray]] = []

    def visit_generic_const_(self, const: Any) -> relax.Expr:
        value = const.value.numpy()
        if not is_weight(value.shape, value.dtype):
            return const
        k = len(self.lifted)
        while f"const{k}" in self.taken:
            k += 1
        self.taken.add(f"const{k}")
        var = relax.Var(f"const{k}", const.ty)
        self.lifted.append((var, value))
        return var


def _lifted_constants(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """``mod`` with the weights bound as constants in ``main`` made parameters after its own,
    and their values by name."""
    main = mod["main"]
    taken = {p.name for p in main.params} | {b.var.name for blk in main.body.blocks
                                              for b in blk.bindings}
    lifter = _LiftConstants(mod, taken)
    body = lifter.visit_expr(main.body)
    if not lifter.lifted:
        return mod, {}
    params = list(main.params) + [v for v, _ in lifter.lifted]
    func = relax.Function(params, body, main.ret_ty, main.is_pure, main.attrs)
    mod = mod.clone()
    mod.update_func(mod.get_global_var("main"), func)
    return mod, {v.name: value for v, value in lifter.lifted}


# ops that move a tensor between devices without changing it: a slope placed on another device
# than its prelu (a Relax module placed by hand) reaches it through one of them
_MOVES = ("relax.to_vdevice", "relax.hint_on_device")


def _through_moves(expr: relax.Expr, var2val: dict) -> relax.Expr | None:
    """What computes ``expr`` (a Var's bound value), looking through device moves."""
    value = var2val.get(expr) if isinstance(expr, relax.Var) else None
    while isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
            and value.op.name in _MOVES:
        arg = value.args[0]
        value = var2val.get(arg) if isinstance(arg, relax.Var) else arg
    return value


def _prelu_axis(x: relax.Expr, alpha: relax.Expr, axis: int, var2val: dict) -> int:
    """The axis a ``relax.nn.prelu`` of ``x`` means: its own, except where TVM's ONNX import
    of a per-channel PRelu before opset 7 wrote it (the slope reshaped to 1-D, ``axis`` the
    last, which the slope does not fit, and the channel axis 1, which it does): there 1."""
    shape, slope = static_dims(x.ty), static_dims(alpha.ty)
    producer = _through_moves(alpha, var2val)
    if shape is None or slope is None or len(slope) != 1 or len(shape) < 3 \
            or axis != len(shape) - 1 or not (isinstance(producer, relax.Call)
                                              and isinstance(producer.op, tvm.ir.Op)
                                              and producer.op.name == "relax.reshape"):
        return axis
    return 1 if shape[axis] != slope[0] and shape[1] == slope[0] else axis


@relax.expr_functor.mutator
class _PreluAxes(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, var2val: dict) -> None:
        super().__init__(mod)
        self.var2val = var2val
        self.rewritten = 0
        self.refused: BuildError | None = None  # (raised after the visit: not through TVM's FFI)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.prelu"):
            return super().visit_call_(call)
        axis = int(call.attrs.axis)
        meant = _prelu_axis(call.args[0], call.args[1], axis, self.var2val)
        shape, slope = static_dims(call.args[0].ty), static_dims(call.args[1].ty)
        if shape is not None and slope is not None and len(slope) == 1 \
                and slope[0] not in (1, shape[meant]):  # the kernel's bare assert, said here
            self.refused = self.refused or BuildError(
                f"relax.nn.prelu of {call.args[0]} {list(shape)}: its slope of {slope[0]} "
                f"values fits no axis it may mean (axis {axis})")
            return super().visit_call_(call)
        if meant == axis:
            return super().visit_call_(call)
        self.rewritten += 1
        return relax.op.nn.prelu(self.visit_expr(call.args[0]), self.visit_expr(call.args[1]),
                                 axis=1)


def _prelu_channel_axes(mod: tvm.IRModule) -> tvm.IRModule:
    """Each ``relax.nn.prelu`` of ``main`` on the axis it means (``_prelu_axis``)."""
    main = mod["main"]
    mutator = _PreluAxes(mod, relax.analysis.get_var2val(main))
    func = mutator.visit_expr(main)
    if mutator.refused is not None:
        raise mutator.refused
    if not mutator.rewritten:
        return mod
    mod = mod.clone()
    mod.update_func(mod.get_global_var("main"), func)
    return mod


def _from_relax(mod: tvm.IRModule, params: dict[str, Any] | None) -> tuple[tvm.IRModule, dict]:
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise BuildError("the Relax IRModule has no 'main' function")
    mod, detached = relax.frontend.detach_params(mod)
    mod, lifted = _lifted_constants(_prelu_channel_axes(mod))
    main = mod["main"]
    given = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v)
             for k, v in (params or {}).items()}
    given.update(lifted)
    if detached.get("main"):
        n = len(detached["main"])
        for p, v in zip(main.params[len(main.params) - n:], detached["main"], strict=True):
            given.setdefault(p.name, v.numpy())
    names = [p.name for p in main.params]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise BuildError(f"params {unknown} are not parameters of main (it takes {names})")
    for p in main.params:  # a weight of another shape failed only when it was loaded
        shape = static_dims(p.ty) if p.name in given else None
        got = given.get(p.name)
        if shape is not None and (tuple(got.shape) != shape or str(got.dtype) != p.ty.dtype):
            raise BuildError(f"param {p.name!r} is {got.dtype}{list(got.shape)}, but main "
                             f"takes {p.ty.dtype}{list(shape)}")
    # weights must come after the user inputs: reorder main's params if needed
    inputs = [p for p in main.params if p.name not in given]
    weights = [p for p in main.params if p.name in given]
    if list(main.params) != inputs + weights:
        main = relax.Function(inputs + weights, main.body, main.ret_ty, main.is_pure, main.attrs)
    main = main.with_attr("num_input", len(inputs))
    mod = mod.clone()
    mod.update_func(mod.get_global_var("main"), main)
    return mod, given


def _from_nn(module: Any, params: dict[str, Any] | None, input_shapes: dict[str, Any] | None
             ) -> tuple[tvm.IRModule, dict]:
    """A ``tvm.relax.frontend.nn.Module``: its ``forward`` exported for ``input_shapes``
    (``{argument: shape}``, float32, or ``{argument: (shape, dtype)}``), its weights from
    ``params`` (by parameter name, ``"fc1.weight"``) or else from each ``Parameter.data``."""
    import inspect

    from tvm.relax.frontend import nn

    args = [n for n in inspect.signature(module.forward).parameters]
    given = dict(input_shapes or {})
    if sorted(given) != sorted(args):
        raise BuildError(f"a tvm.relax.frontend.nn module is exported for the shapes of its "
                         f"forward's arguments: input_shapes must name exactly {args}, got "
                         f"{sorted(given)}")
    spec = {}
    for name in args:
        shape, dtype = given[name], "float32"
        if isinstance(shape, tuple) and len(shape) == 2 and isinstance(shape[1], str):
            shape, dtype = shape
        if not isinstance(shape, (list, tuple)) or \
                not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
            raise BuildError(f"input_shapes[{name!r}] = {given[name]!r}: expected sizes >= 0 "
                             f"(and a dtype: (shape, 'float16'))")
        spec[name] = nn.spec.Tensor([int(d) for d in shape], dtype)
    try:
        exported, named = module.export_tvm(spec={"forward": spec})
    except Exception as e:
        raise BuildError(f"exporting the nn module's forward failed: {e}") from e
    values = dict(params or {})
    unknown = sorted(set(values) - {n for n, _ in named})
    if unknown:
        raise BuildError(f"params {unknown} are not parameters of the module (it has "
                         f"{[n for n, _ in named]})")
    missing = [n for n, p in named if n not in values and p.data is None]
    if missing:
        raise BuildError(f"the module's parameters {missing} hold no data: set each "
                         f"(param.data = ...) or pass params={{name: array}}")
    func = exported["forward"]
    # forward becomes main; the functions it calls (tensor_ir_op's PrimFuncs) stay
    renamed = tvm.IRModule({**{gv: f for gv, f in exported.functions_items()
                               if gv.name_hint != "forward"},
                            "main": func.with_attr("global_symbol", "main")})
    # main's weight parameters come in the order export_tvm names them
    weights = {var.name: values.get(name, param.data)
               for var, (name, param) in zip(func.params[len(args):], named, strict=True)}
    return _from_relax(renamed, weights)


def import_model(model: Any, params: dict[str, Any] | None = None,
                 input_shapes: dict[str, Any] | None = None
                 ) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Import ``model`` (onnx ModelProto, path to a .onnx file, Relax IRModule, or a
    ``tvm.relax.frontend.nn.Module``: ``_from_nn``).

    >>> mod, params = import_model("model.onnx")  # doctest: +SKIP
    >>> mod["main"].attrs["num_input"], sorted(params)[:2]  # doctest: +SKIP
    """
    if isinstance(model, tvm.IRModule):
        if input_shapes:
            raise BuildError("input_shapes applies to ONNX models; a Relax IRModule carries its "
                             "own shapes")
        mod, weights = _from_relax(model, params)
    elif isinstance(model, (str, os.PathLike)) or type(model).__name__ == "ModelProto":
        if params:
            raise BuildError("params are read from the ONNX model; do not pass them separately")
        mod, weights = _from_onnx(model, input_shapes)
    elif isinstance(model, relax.frontend.nn.Module):
        mod, weights = _from_nn(model, params, input_shapes)
    else:
        raise BuildError(f"cannot import a {type(model).__name__}: give an onnx ModelProto, a "
                         f"path to an .onnx file, a Relax IRModule or a "
                         f"tvm.relax.frontend.nn.Module")
    mod = inference_dropouts(pairwise_reductions(mod))
    mod, weights = recognised_patterns(*fold_weight_transforms(mod, weights))
    return elementwise_through_concats(mod), weights

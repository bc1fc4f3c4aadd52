"""Subgraphs that are one op, made that op whatever the exporter wrote (``recognised_patterns``,
run by ``import_model`` on ONNX and Relax inputs alike), so that placement rules and kernel
providers see one op. ``PATTERNS`` is the rule table, keyed by the op of a pattern's last
binding (its anchor); what each rule matches:

* ``clip``: ``minimum(maximum(x, lo), hi)`` (or ``maximum(minimum(x, hi), lo)``), the bounds
  scalar constants with ``lo <= hi`` → ``R.clip(x, lo, hi)``. ONNX ``Clip`` of every opset
  imports so (``elementwise.convert_clip``), ReLU6 as torch exports it among them; a bound
  written ``where(isnan(c), -inf, c)`` of a constant ``c`` (TVM's own import) is read as ``c``.
* ``silu``: ``x * sigmoid(x)``, either order → ``R.nn.silu(x)``.
* ``gelu``: ``0.5 * x * (1 + erf(x / sqrt(2)))`` in any order and grouping of its products
  and sums (torch's ``(x * (erf(x / 1.414...) + 1)) * 0.5``, transformers'
  ``x * 0.5 * (1 + erf(x * 0.7071...))``, a divide by a constant as a multiply by its
  reciprocal) → ``R.nn.gelu(x)``; ``gelu_tanh``: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x +
  0.044715 x^3)))`` (``x^3`` as ``pow(x, 3)`` or ``x * x * x``) → ``R.nn.gelu_tanh(x)``.
* ``hardswish``: ``x * clip(a*x + b, 0, hi) * k`` with ``a/hi = 1/6``, ``b/hi = 1/2``,
  ``k*hi = 1``: ``x * relu6(x + 3) / 6``, ``x * hardsigmoid(x)`` and ONNX ``HardSwish`` as TVM
  imports it. Relax has no hardswish op, so it becomes one ``R.call_tir`` of a PrimFunc named
  ``hgrt_hardswish`` (attr ``hgrt.pattern = "hardswish"``, an element-wise kernel that fuses as
  any other): the node a kernel provider matches.
* ``layer_norm``: ``(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)`` over the last axis
  (means with ``keepdims``; the square as ``pow(d, 2)`` or ``d * d``; the division as a
  multiply by ``1 / sqrt(...)`` or ``rsqrt(...)``; the difference computed once or twice),
  then optionally times gamma and plus beta (weights or constants along the last axis) →
  ``R.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=eps)``; a gamma or beta the model
  lacks, or of another shape than ``(C,)``, is a new weight. ONNX ``LayerNormalization``
  already imports as that op, and ``Softmax`` as one ``R.nn.softmax``.
* ``global_average_pool``: ``avg_pool1d``/``avg_pool2d``/``avg_pool3d`` whose one window,
  starting at 0 with no padding and no dilation, covers the whole input (on each spatial axis
  ``pool_size`` at least the input's extent and the output's extent 1) → ``R.mean(x,
  axis=spatial, keepdims=True)``: a window past the input's edge (``ceil_mode``) is clipped to
  it and divided by what it covers, with or without ``count_include_pad``. ONNX
  ``AveragePool`` with a kernel larger than its input (transformers' EfficientNet: 1280x1280
  on 7x7) imports so, and TVM's kernel for it pads the input out to the window. Layouts
  ``NCW``/``NWC``, ``NCHW``/``NHWC`` and ``NCDHW``/``NDHWC``.

A rule rewrites only where it is exact: float32 tensors, constants equal to the pattern's
within float32 rounding (``RTOL``), scalar where the pattern has a scalar, axes and shapes
checked, and every intermediate read only inside the pattern (an intermediate read elsewhere
is still computed, so nothing would be saved). The rewritten binding keeps its name (what a
placement override names); the pieces go with dead code, and so do the weights only they read.
Constants are ``R.const`` or weights (``main``'s parameters after ``num_input``, whose values
the pass is given).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax, te

from hgrt.relay_passes.inner.simplify import _reads
from hgrt.relay_passes.util.relax_util import op_name, static_dims

RTOL = 1e-6  # constants equal within float32 rounding (a few ulps: 2**-23 is 1.2e-7)
MAX_TERMS = 8  # a polynomial with more terms than this is no activation of this table
Poly = dict[tuple[str, ...], float]  # monomial (sorted atom names) -> coefficient
ARITHMETIC = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide",
                        "relax.power", "relax.negative"})


class _Main:
    """What the rules read of ``main``: bindings, reads, the values of constants."""

    def __init__(self, func: relax.Function, weights: dict[str, np.ndarray]) -> None:
        self.var2val = relax.analysis.get_var2val(func)
        self.reads = _reads(func)
        n_in = int(func.attrs["num_input"]) if "num_input" in func.attrs else len(func.params)
        self.weights = {p: weights[p.name] for p in func.params[n_in:] if p.name in weights}

    def value(self, expr: relax.Expr) -> np.ndarray | None:
        """The value of a constant, a weight, or ``where(isnan(c), r, c)`` of constants."""
        if isinstance(expr, tvm.ir.GenericConst):
            return expr.value.numpy()
        if expr in self.weights:
            return self.weights[expr]
        call = self.var2val.get(expr) if isinstance(expr, relax.Var) else None
        if op_name(call) == "relax.where" and op_name(self.var2val.get(call.args[0])) \
                == "relax.isnan":
            c, r = self.value(self.var2val[call.args[0]].args[0]), self.value(call.args[1])
            d = self.value(call.args[2])
            if c is not None and r is not None and d is not None:
                return np.where(np.isnan(c), r, d)
        return None

    def scalar(self, expr: relax.Expr, rank: int) -> float | None:
        """The float of a one-element float constant that broadcasts onto rank ``rank``."""
        v = self.value(expr)
        if v is None or v.size != 1 or v.ndim > rank or v.dtype.kind != "f":
            return None
        return float(v.reshape(()))

    def inner(self, expr: relax.Expr, uses: Counter) -> relax.Call | None:
        """The op call an intermediate ``expr`` is bound to (its read counted in ``uses``)."""
        call = self.var2val.get(expr) if isinstance(expr, relax.Var) else None
        if not isinstance(call, relax.Call) or op_name(call) is None:
            return None
        uses[expr] += 1
        return call

    def read_inside(self, uses: Counter, outside: list[relax.Expr]) -> bool:
        """Whether every intermediate in ``uses`` is read only where the pattern counted it,
        and none would be read outside its dataflow block once the pattern reads ``outside``
        (its operands) in its place."""
        if any(self.reads.get(v, 0) != n for v, n in uses.items()):
            return False
        return not any(isinstance(o, relax.DataflowVar) for o in outside) or all(
            isinstance(v, relax.DataflowVar) for v in uses)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=RTOL * 1e-3)


def _same(p: Poly | None, q: Poly) -> bool:
    return p is not None and p.keys() == q.keys() and all(_close(p[k], q[k]) for k in q)


def _times(p: Poly, q: Poly) -> Poly | None:
    out: Poly = {}
    for a, x in p.items():
        for b, y in q.items():
            key = tuple(sorted(a + b))
            out[key] = out.get(key, 0.0) + x * y
    return out if len(out) <= MAX_TERMS and all(len(k) <= 4 for k in out) else None


def _plus(p: Poly, q: Poly, sign: float = 1.0) -> Poly:
    out = dict(p)
    for k, v in q.items():
        out[k] = out.get(k, 0.0) + sign * v
    return {k: v for k, v in out.items() if v != 0.0}


class _Polynomial:
    """An element-wise expression as a polynomial over its atoms (tensors read, and the
    activations in ``functions`` of intermediates), through intermediates of add, subtract,
    multiply, divide by a constant, negative and small integer powers."""

    def __init__(self, m: _Main, rank: int, uses: Counter) -> None:
        self.m, self.rank, self.uses = m, rank, uses
        self.atoms: dict[str, relax.Expr] = {}

    def of(self, expr: relax.Expr) -> Poly | None:
        """``expr`` (a binding's argument) as a polynomial, or None."""
        c = self.m.scalar(expr, self.rank)
        if c is not None:
            return {(): c}
        if not isinstance(expr, relax.Var):
            return None
        call = self.m.var2val.get(expr)
        if op_name(call) in ARITHMETIC and self.m.reads.get(expr) == 1:
            saved = Counter(self.uses)
            p = self.call(call)
            if p is not None:
                self.uses[expr] += 1
                return p
            self.uses.clear()
            self.uses.update(saved)
        self.atoms[expr.name] = expr
        return {(expr.name,): 1.0}

    def call(self, call: relax.Call) -> Poly | None:
        """An arithmetic ``call`` as a polynomial, or None."""
        name = op_name(call)
        if name not in ARITHMETIC or str(call.ty.dtype) != "float32":
            return None
        return self._op(name, call)

    def _op(self, name: str, call: relax.Call) -> Poly | None:
        if name == "relax.negative":
            p = self.of(call.args[0])
            return None if p is None else {k: -v for k, v in p.items()}
        if name in ("relax.divide", "relax.power"):
            p, c = self.of(call.args[0]), self.m.scalar(call.args[1], self.rank)
            if p is None or c is None:
                return None
            if name == "relax.divide":
                return None if c == 0.0 else {k: v / c for k, v in p.items()}
            if c not in (1.0, 2.0, 3.0, 4.0):
                return None
            out: Poly | None = p
            for _ in range(int(c) - 1):
                out = None if out is None else _times(out, p)
            return out
        p, q = self.of(call.args[0]), self.of(call.args[1])
        if p is None or q is None:
            return None
        if name == "relax.multiply":
            return _times(p, q)
        return _plus(p, q, -1.0 if name == "relax.subtract" else 1.0)


def _activation(m: _Main, call: relax.Call, functions: tuple[str, ...]
                ) -> tuple[Poly, relax.Var, relax.Call, Counter] | None:
    """``call`` as a polynomial in one tensor ``x`` and one activation ``f(z)`` (``f`` in
    ``functions``, read only here): (polynomial with ``x`` as ``"x"`` and ``f(z)`` as
    ``"f"``, ``x``, the call ``f(z)``, the intermediates' reads)."""
    uses: Counter = Counter()
    poly = _Polynomial(m, len(call.ty.shape.values) if call.ty.shape is not None else 0, uses)
    p = poly.call(call)
    if p is None or len(poly.atoms) != 2 or str(call.ty.dtype) != "float32":
        return None
    f = [a for a in poly.atoms.values() if op_name(m.var2val.get(a)) in functions
         and m.reads.get(a) == 1]
    x = [a for a in poly.atoms.values() if not any(a.same_as(g) for g in f)]
    if len(f) != 1 or len(x) != 1:
        return None
    f_call = m.inner(f[0], uses)
    names = {f[0].name: "f", x[0].name: "x"}
    renamed = {tuple(sorted(names[a] for a in k)): v for k, v in p.items()}
    if not _same_type(x[0].ty, call.ty):
        return None
    return renamed, x[0], f_call, uses


def _same_type(a: relax.Type, b: relax.Type) -> bool:
    """Whether two tensor types have one static shape and dtype."""
    return static_dims(a) is not None and static_dims(a) == static_dims(b) \
        and str(a.dtype) == str(b.dtype)


def _argument(m: _Main, f_call: relax.Call, x: relax.Var, uses: Counter) -> Poly | None:
    """The activation's argument as a polynomial in ``x`` alone (``"x"``)."""
    arg = f_call.args[0]
    if arg.same_as(x):
        return {("x",): 1.0}
    poly = _Polynomial(m, len(x.ty.shape.values), uses)
    p = poly.of(arg)
    if p is None or set(poly.atoms) - {x.name}:
        return None
    return {tuple("x" for _ in k): v for k, v in p.items()}


Rewrite = Callable[["_Rewriter"], relax.Expr]


def _unary(m: _Main, call: relax.Call, function: str, outer: Poly, inner: Poly,
           make: Callable[[relax.Expr], relax.Expr]) -> Rewrite | None:
    """``outer`` in ``x`` and ``function(z)``, ``z`` being ``inner`` in ``x`` → ``make(x)``."""
    found = _activation(m, call, (function,))
    if found is None or not _same(found[0], outer):
        return None
    p, x, f_call, uses = found
    if not _same(_argument(m, f_call, x, uses), inner) or not m.read_inside(uses, [x]):
        return None
    return lambda r: make(r.visit_expr(x))


def silu(m: _Main, call: relax.Call) -> Rewrite | None:
    return _unary(m, call, "relax.sigmoid", {("f", "x"): 1.0}, {("x",): 1.0}, relax.op.nn.silu)


def gelu(m: _Main, call: relax.Call) -> Rewrite | None:
    return _unary(m, call, "relax.erf", {("x",): 0.5, ("f", "x"): 0.5},
                  {("x",): 1 / math.sqrt(2.0)}, relax.op.nn.gelu)


def gelu_tanh(m: _Main, call: relax.Call) -> Rewrite | None:
    s = math.sqrt(2.0 / math.pi)
    return _unary(m, call, "relax.tanh", {("x",): 0.5, ("f", "x"): 0.5},
                  {("x",): s, ("x", "x", "x"): s * 0.044715}, relax.op.nn.gelu_tanh)


def _clip_bounds(call: relax.Call) -> tuple[float, float] | None:
    if op_name(call) == "relax.nn.relu6":
        return 0.0, 6.0
    bounds = [getattr(b, "value", None) for b in call.args[1:3]]  # IntImm or FloatImm
    if not all(isinstance(b, (int, float)) for b in bounds):
        return None
    return float(bounds[0]), float(bounds[1])


def hardswish(m: _Main, call: relax.Call) -> Rewrite | None:
    found = _activation(m, call, ("relax.clip", "relax.nn.relu6"))
    if found is None or set(found[0]) != {("f", "x")}:
        return None
    p, x, f_call, uses = found
    bounds, z = _clip_bounds(f_call), _argument(m, f_call, x, uses)
    if bounds is None or z is None or set(z) - {("x",), ()} or bounds[0] != 0.0 \
            or not bounds[1] > 0.0 or not m.read_inside(uses, [x]):
        return None
    hi = bounds[1]
    if not (_close(z.get(("x",), 0.0) / hi, 1 / 6) and _close(z.get((), 0.0) / hi, 0.5)
            and _close(p[("f", "x")] * hi, 1.0)):
        return None
    return lambda r: r.hardswish(r.visit_expr(x))


def hardswish_func(shape: tuple[int, ...], dtype: str) -> tvm.tirx.PrimFunc:
    """The element-wise kernel ``x * clip(x + 3, 0, 6) / 6``."""
    shape = [tvm.tirx.IntImm("int64", d) for d in shape]  # as Relax's shapes are
    x = te.placeholder(shape, dtype, "x")
    three, six = tvm.tirx.const(3.0, dtype), tvm.tirx.const(6.0, dtype)
    zero = tvm.tirx.const(0.0, dtype)
    y = te.compute(shape, lambda *i: x(*i) * te.min(te.max(x(*i) + three, zero), six) / six,
                   name="hardswish")
    # (create_prim_func names it "main": the module's symbol would be taken twice; the
    # global variable it is added under names it)
    return te.create_prim_func([x, y]).without_attr("global_symbol") \
        .with_attr("hgrt.pattern", "hardswish")


def clip(m: _Main, call: relax.Call) -> Rewrite | None:
    outer = op_name(call)
    uses: Counter = Counter()
    inner = m.inner(call.args[0], uses)
    want = "relax.maximum" if outer == "relax.minimum" else "relax.minimum"
    if op_name(inner) != want or str(call.ty.dtype) != "float32":
        return None
    x = inner.args[0]
    rank = len(x.ty.shape.values) if x.ty.shape is not None else 0
    b_in, b_out = m.scalar(inner.args[1], rank), m.scalar(call.args[1], rank)
    if b_in is None or b_out is None or not _same_type(x.ty, call.ty) \
            or not m.read_inside(uses, [x]):
        return None
    lo, hi = (b_in, b_out) if outer == "relax.minimum" else (b_out, b_in)
    if not lo <= hi:
        return None
    return lambda r: relax.op.clip(r.visit_expr(x), tvm.tirx.FloatImm("float32", lo),
                                   tvm.tirx.FloatImm("float32", hi))


def _last_axis_mean(m: _Main, var: relax.Expr, rank: int, uses: Counter) -> relax.Expr | None:
    """The operand of an intermediate ``mean(t, axis=[-1], keepdims=True)``."""
    call = m.inner(var, uses)
    if op_name(call) != "relax.mean" or not bool(call.attrs.keepdims) \
            or call.attrs.axis is None or len(call.attrs.axis) != 1 \
            or int(call.attrs.axis[0]) % rank != rank - 1:
        return None
    return call.args[0]


def _differences(m: _Main, ds: list[relax.Expr], rank: int, uses: Counter
                 ) -> relax.Expr | None:
    """The ``x`` of which every var in ``ds`` is ``x - mean(x)`` (one mean, read by each)."""
    subtracts: list[relax.Expr] = []
    for d in ds:
        if not any(d.same_as(s) for s in subtracts):
            subtracts.append(d)
        uses[d] += 1
    calls = [m.var2val.get(d) for d in subtracts]
    if any(op_name(c) != "relax.subtract" for c in calls):
        return None
    x, mean = calls[0].args
    if any(not (c.args[0].same_as(x) and c.args[1].same_as(mean)) for c in calls):
        return None
    uses[mean] += len(calls) - 1
    mean_of = _last_axis_mean(m, mean, rank, uses)
    return x if mean_of is not None and mean_of.same_as(x) else None


def _inverse_root(m: _Main, y: relax.Call, uses: Counter
                  ) -> tuple[relax.Expr, relax.Expr] | None:
    """``(d, v)`` where ``y`` is ``d / sqrt(v)``, ``d * (1 / sqrt(v))`` or ``d * rsqrt(v)``."""
    if op_name(y) == "relax.divide":
        root = m.inner(y.args[1], uses)
        return (y.args[0], root.args[0]) if op_name(root) == "relax.sqrt" else None
    if op_name(y) != "relax.multiply":
        return None
    for d, r in (y.args, reversed(y.args)):
        tried = Counter()
        inv = m.inner(r, tried)
        if op_name(inv) == "relax.divide" and m.scalar(inv.args[0], 0) == 1.0:
            inv = m.inner(inv.args[1], tried)
            inv = inv if op_name(inv) == "relax.sqrt" else None
        if op_name(inv) in ("relax.rsqrt", "relax.sqrt"):
            uses.update(tried)
            return d, inv.args[0]
    return None


def _normalised(m: _Main, y: relax.Call, uses: Counter) -> tuple[relax.Expr, float] | None:
    """``(x, eps)`` where ``y`` is ``(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)`` over
    the last axis."""
    rank = len(y.ty.shape.values) if y.ty.shape is not None else 0
    found = _inverse_root(m, y, uses) if rank else None
    add = None if found is None else m.inner(found[1], uses)
    if op_name(add) != "relax.add" or op_name(y) == "relax.add":
        return None
    v, eps = next(((v, m.scalar(e, rank)) for v, e in (add.args, reversed(add.args))
                   if m.scalar(e, rank) is not None), (None, None))
    sq = None if eps is None or eps < 0 else _last_axis_mean(m, v, rank, uses)
    sq = None if sq is None else m.inner(sq, uses)
    if op_name(sq) == "relax.power" and m.scalar(sq.args[1], rank) == 2.0:
        ds = [found[0], sq.args[0]]
    elif op_name(sq) == "relax.multiply":
        ds = [found[0], *sq.args]
    else:
        return None
    x = _differences(m, ds, rank, uses)
    return None if x is None or not _same_type(x.ty, y.ty) else (x, eps)


def _along_last(m: _Main, y: relax.Call, uses: Counter, width: int
                ) -> tuple[relax.Call, relax.Expr] | None:
    """``(t, w)`` where ``y`` is ``t op w`` (either order), ``t`` an intermediate and ``w`` a
    weight, constant or tensor along the last axis (``width`` values, or one)."""
    for t, w in (y.args, reversed(y.args)):
        dims = static_dims(w.ty) if isinstance(w.ty, relax.TensorType) else None
        if dims is None or len(dims) > len(y.ty.shape.values) or math.prod(dims) not in (
                1, width) or dims[-1:] not in ((), (1,), (width,)) or str(w.ty.dtype) != \
                "float32" or (m.value(w) is None and dims != (width,)):
            continue
        tried = Counter()
        inner = m.inner(t, tried)
        if inner is not None:
            uses.update(tried)
            return inner, w
    return None


def layer_norm(m: _Main, call: relax.Call) -> Rewrite | None:
    if str(call.ty.dtype) != "float32" or static_dims(call.ty) is None:
        return None
    width = static_dims(call.ty)[-1]
    y, affine, uses = call, {}, Counter()
    for op, role in (("relax.add", "beta"), ("relax.multiply", "gamma")):
        if op_name(y) == op and _normalised(m, y, Counter()) is None:
            peeled = _along_last(m, y, uses, width)
            if peeled is None:
                return None
            y, affine[role] = peeled
    found = _normalised(m, y, uses)
    if found is None or not m.read_inside(uses, [found[0], *affine.values()]):
        return None
    x, eps = found

    def rewrite(r: _Rewriter) -> relax.Expr:
        gamma, beta = (r.vector(affine.get(k), fill, width, f"{k}")
                       for k, fill in (("gamma", 1.0), ("beta", 0.0)))
        return relax.op.nn.layer_norm(r.visit_expr(x), gamma, beta, axes=[-1], epsilon=eps)
    return rewrite


# the spatial axes of an average pool's layouts, in the order of its pool_size
POOL_LAYOUTS = {"NCW": (2,), "NWC": (1,), "NCHW": (2, 3), "NHWC": (1, 2),
                "NCDHW": (2, 3, 4), "NDHWC": (1, 2, 3)}


def global_average_pool(m: _Main, call: relax.Call) -> Rewrite | None:
    a, x = call.attrs, call.args[0]
    axes = POOL_LAYOUTS.get(str(a.layout))
    dims, out = static_dims(x.ty), static_dims(call.ty)
    if axes is None or str(a.out_layout) != str(a.layout) or dims is None or out is None \
            or len(dims) != len(axes) + 2 or len(a.pool_size) != len(axes) \
            or str(x.ty.dtype) != "float32" or str(call.ty.dtype) != "float32":
        return None
    if any(out[i] != (1 if i in axes else dims[i]) for i in range(len(dims))) \
            or any(int(p) != 0 for p in a.padding) or any(int(d) != 1 for d in a.dilation) \
            or any(int(k) < dims[i] for k, i in zip(a.pool_size, axes, strict=True)):
        return None
    return lambda r: relax.op.mean(r.visit_expr(x), axis=list(axes), keepdims=True)


Rule = Callable[[_Main, relax.Call], "Rewrite | None"]
PATTERNS: dict[str, tuple[Rule, ...]] = {
    "relax.nn.avg_pool1d": (global_average_pool,),
    "relax.nn.avg_pool2d": (global_average_pool,),
    "relax.nn.avg_pool3d": (global_average_pool,),
    "relax.minimum": (clip,),
    "relax.maximum": (clip,),
    "relax.multiply": (silu, hardswish, gelu, gelu_tanh, layer_norm),
    "relax.divide": (hardswish, gelu, gelu_tanh, layer_norm),
    "relax.add": (gelu, gelu_tanh, layer_norm),
}


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, m: _Main, names: set[str]) -> None:
        super().__init__(mod)
        self.m, self.names = m, names
        self.rewritten = 0
        self.new_weights: dict[relax.Var, np.ndarray] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        for rule in PATTERNS.get(op_name(call), ()):
            rewrite = rule(self.m, call)
            if rewrite is not None:
                self.rewritten += 1
                return self.builder_.normalize(rewrite(self))
        return super().visit_call_(call)

    def vector(self, given: relax.Expr | None, fill: float, width: int, base: str
               ) -> relax.Expr:
        """``given`` as a (width,) tensor: itself where it is one, else a new weight."""
        if given is not None and static_dims(given.ty) == (width,):
            return self.visit_expr(given)
        value = np.full((width,), fill, "float32") if given is None else np.broadcast_to(
            self.m.value(given).reshape(-1), (width,)).astype("float32")
        k = 0
        while f"{base}{k}" in self.names:
            k += 1
        self.names.add(f"{base}{k}")
        var = relax.Var(f"{base}{k}", relax.TensorType((width,), "float32"))
        self.new_weights[var] = value
        return var

    def hardswish(self, x: relax.Expr) -> relax.Expr:
        gv = self.builder_.add_func(hardswish_func(static_dims(x.ty), str(x.ty.dtype)),
                                    "hgrt_hardswish")
        return relax.call_tir(gv, relax.Tuple([x]), x.ty)


def _one_round(mod: tvm.IRModule, weights: dict[str, np.ndarray]
               ) -> tuple[tvm.IRModule, dict[str, np.ndarray]] | None:
    func = mod["main"]
    m = _Main(func, weights)
    names = {p.name for p in func.params} | {v.name for v in m.var2val}
    r = _Rewriter(mod, m, names)
    body = r.visit_expr(func.body)
    if not r.rewritten:
        return None
    params = [*func.params, *r.new_weights]
    out = r.builder_.get()
    out.update_func(out.get_global_var("main"),
                    relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs))
    out = relax.transform.DeadCodeElimination(["main"])(out)
    weights = {**weights, **{v.name: value for v, value in r.new_weights.items()}}
    return _without_unread_weights(out, weights, set(m.reads) | set(r.new_weights))


def _without_unread_weights(mod: tvm.IRModule, weights: dict[str, np.ndarray], read: set
                            ) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """``main`` without the weights that only the rewritten pieces read (those in ``read``
    that nothing reads now)."""
    func = mod["main"]
    n_in = int(func.attrs["num_input"])
    reads = _reads(func)
    dead = [p for p in func.params[n_in:] if p in read and not reads.get(p)]
    if not dead:
        return mod, weights
    params = [p for p in func.params if not any(p.same_as(d) for d in dead)]
    mod = mod.clone()
    mod.update_func(mod.get_global_var("main"), relax.Function(
        params, func.body, func.ret_ty, func.is_pure, func.attrs))
    return mod, {k: v for k, v in weights.items() if k not in {d.name for d in dead}}


def recognised_patterns(mod: tvm.IRModule, weights: dict[str, np.ndarray]
                        ) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """``mod`` with each subgraph of ``main`` that ``PATTERNS`` recognises made its one op,
    and the weights of its ``main`` by name (see module doc); ``(mod, weights)`` themselves
    when nothing is recognised.

    ``main`` takes its inputs first (``num_input`` attr), then the weights named in
    ``weights``. A pattern made of another's result (a HardSwish written with ReLU6) is
    recognised in a second round.
    """
    for _ in range(3):
        done = _one_round(mod, weights)
        if done is None:
            break
        mod, weights = done
    return mod, weights

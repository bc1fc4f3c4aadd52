"""A transformer's ops between its dense layers as oneDNN kernels (``onednn_rows.cc``): a layer
norm over the last axis, a softmax over the last axis (with the exporters' ``where(isnan(s),
value, s)`` after it), and the matmul of two activations (attention's QK^T and its product with
V; with an add after it of a tensor that broadcasts onto it: the mask), its operands read and
its product written through strided views of the tensors around it (``_matmul``). They hold no
packed weights; ``claim_onednn`` gives one to oneDNN where ``auto_choice`` finds that it pays:
on oneDNN's OpenMP team, between oneDNN's dense layers, they spare the switches between thread
pools that TVM's kernels there cost (130-150 us each, ``auto_choice``), and oneDNN's matmul of
two activations is 2.3-3.5x TVM's (vit's (12, 197, 64) x (12, 64, 197) 281 against 980 us, EPYC
AVX-512, 2 threads; ``python/bench_onednn_primitives.cc`` and ``hgrt profile``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
from tvm import relax

from hgrt.providers.onednn import PROVIDER
from hgrt.providers.onednn.chains import ChainGraph
from hgrt.providers.onednn.policy import runs_onednn
from hgrt.relay_passes.util.kernels import Kernels
from hgrt.relay_passes.util.relax_util import bindings, op_name, static_dims

FUNC_NAME = {kind: PROVIDER.func_prefix + kind for kind in ("layer_norm", "softmax", "matmul")}

__all__ = ["FUNC_NAME", "RowOp", "find_rows"]


@dataclass
class RowOp:
    """A layer norm, softmax or matmul of two activations that one oneDNN kernel computes."""

    kind: str  # a key of FUNC_NAME
    root: relax.VarBinding
    args: list[relax.Var]  # the activations the kernel reads, in order
    members: list[relax.Var]  # [transposes it reads through,] root, ..., the kernel's result
    params: np.ndarray | None = None  # a new float32 weight read after the args
    read: list[relax.Expr] = field(default_factory=list)  # weights it folded into params
    label: list[str] = field(default_factory=list)
    choice: str = "auto"
    macs: int = 0

    @property
    def end(self) -> relax.Var:
        return self.members[-1]

    @property
    def elements(self) -> int:
        return math.prod(static_dims(self.end.ty) or (0,))


def _float32(v: relax.Expr, g: ChainGraph) -> tuple[int, ...] | None:
    """The static shape of a float32 activation (a variable, not a weight), else None."""
    if not isinstance(v, relax.Var) or v in g.weights or str(getattr(v.ty, "dtype", "")) \
            != "float32":
        return None
    dims = static_dims(v.ty)
    return tuple(dims) if dims is not None else None


def _last_axis(axis: int, rank: int) -> bool:
    return rank >= 1 and axis in (-1, rank - 1)


def _layer_norm(g: ChainGraph, b: relax.VarBinding) -> RowOp | None:
    call, a = b.value, b.value.attrs
    x, gamma, beta = call.args
    shape = _float32(x, g)
    axes = [int(v) for v in a.axes]
    if shape is None or len(axes) != 1 or not _last_axis(axes[0], len(shape)):
        return None
    c = shape[-1]
    scale, shift = g.value(gamma), g.value(beta)
    if scale is None or shift is None or scale.size != c or shift.size != c:
        return None
    scale = scale.reshape(c) if a.scale else np.ones(c, "float32")
    shift = shift.reshape(c) if a.center else np.zeros(c, "float32")
    params = np.concatenate([scale, shift, [float(a.epsilon)]]).astype("float32")
    return RowOp("layer_norm", b, [x], [b.var], params, [gamma, beta], ["layer_norm"])


def _nan_to(g: ChainGraph, s: relax.Var) -> tuple[list[relax.Var], float] | None:
    """``where(isnan(s), value, s)`` reading ``s`` (and nothing else does): its isnan and where
    bindings, and the value (a constant number)."""
    users = g.users.get(s, [])
    if len(users) != 2 or None in users:
        return None
    isnan = next((u for u in users if op_name(u.value) == "relax.isnan"), None)
    where = g.only_user(isnan.var) if isnan is not None else None
    if where is None or op_name(where.value) != "relax.where" or where not in users:
        return None
    cond, value, other = where.value.args
    number = g.value(value)
    if not cond.same_as(isnan.var) or not other.same_as(s) or number is None \
            or number.size != 1 or static_dims(where.var.ty) != static_dims(s.ty):
        return None
    return [isnan.var, where.var], float(number.reshape(()))


def _softmax(g: ChainGraph, b: relax.VarBinding) -> RowOp | None:
    (x,) = b.value.args
    shape = _float32(x, g)
    if shape is None or not _last_axis(int(b.value.attrs.axis), len(shape)):
        return None
    op = RowOp("softmax", b, [x], [b.var], np.array([0, 0], "float32"), label=["softmax"])
    nan = _nan_to(g, b.var)
    if nan is not None:
        op.members += nan[0]
        op.params = np.array([1, nan[1]], "float32")
        op.label.append("nan_to")
    return op


def _broadcasts(d: tuple[int, ...], out: tuple[int, ...]) -> bool:
    return len(d) <= len(out) and all(
        x in (1, y) for x, y in zip(reversed(d), reversed(out), strict=False))


def _fast_addend(d: tuple[int, ...], out: tuple[int, ...]) -> bool:
    """Whether oneDNN's matmul keeps its fast kernels (brgemm; gemm on AVX2) with an add of
    ``d`` onto the product ``out``: ``d`` a row of N, or whole in the first batch axis and the
    last two (others broadcast). Any other broadcast (over the first batch axis, or the rows: a
    relative position bias of (1, heads, M, N) onto (windows, heads, M, N)) takes its
    reference kernel, 50x slower or worse (oneDNN 3.x's matmul_pd implementations)."""
    d = (1,) * (len(out) - len(d)) + tuple(d)
    if all(x == 1 for x in d[:-1]) and d[-1] == out[-1]:
        return True
    return d[-2:] == out[-2:] and (len(out) == 2 or d[0] == out[0])


def _unit_free(dims: tuple[int, ...]) -> list[int]:
    """The axes of ``dims`` that are not 1."""
    return [i for i, d in enumerate(dims) if d != 1]


def _scalar_of(g: ChainGraph, call: relax.Call) -> tuple[relax.Var, float] | None:
    """``(x, s)`` where ``call`` is ``x * c``, ``c * x`` or ``x / c`` of a finite non-zero
    scalar constant ``c`` (``s``: ``c`` or ``1 / c``)."""
    pairs = [call.args] if op_name(call) == "relax.divide" else [call.args, call.args[::-1]]
    for x, k in pairs:
        c = g.value(k)
        if not isinstance(x, relax.Var) or c is None or c.size != 1:
            continue
        value = float(c.reshape(()))
        if not math.isfinite(value) or value == 0.0:
            return None
        return x, value if op_name(call) == "relax.multiply" else 1.0 / value
    return None


def _step_back(g: ChainGraph, c: relax.Var, axis_of: list[int | None]
               ) -> tuple[relax.Var, list[int | None], float] | None:
    """One op back from ``c``: ``(its input, axis_of in the input's axes, a scale)`` where
    ``c`` is a transpose, a reshape that only adds or drops axes of 1, or a product by a
    scalar constant of its input (``axis_of``: for each axis of the operand, ``c``'s axis it
    is, None for an axis of 1)."""
    b = g.binding_of.get(c)
    name = op_name(b.value) if b is not None else None
    if name not in ("relax.permute_dims", "relax.reshape", "relax.multiply", "relax.divide"):
        return None
    if name in ("relax.multiply", "relax.divide"):
        scaled = _scalar_of(g, b.value)
        if scaled is None or static_dims(scaled[0].ty) != static_dims(c.ty):
            return None
        return scaled[0], axis_of, scaled[1]

    u = b.value.args[0]
    su, sc = static_dims(u.ty) if isinstance(u, relax.Var) else None, static_dims(c.ty)
    if su is None or sc is None:
        return None
    if name == "relax.permute_dims":
        if b.value.attrs.axes is None:
            return None
        axes = [int(i) for i in b.value.attrs.axes]  # c's axis i is u's axes[i]
        return u, [None if i is None else axes[i] for i in axis_of], 1.0
    cu, uu = _unit_free(tuple(sc)), _unit_free(tuple(su))
    if [sc[i] for i in cu] != [su[j] for j in uu]:
        return None
    to_u = dict(zip(cu, uu, strict=True))
    return u, [None if i is None else to_u.get(i) for i in axis_of], 1.0


def _view(dims: tuple[int, ...], axis_of: list[int | None], base: tuple[int, ...]
          ) -> list[int]:
    """The dims then the strides (elements of ``base``, row-major) of a view; an axis of 1
    steps over the whole tensor, as a leading axis would (oneDNN takes a stride of 0 for a
    broadcast and leaves its fast kernels)."""
    strides = [math.prod(base[j + 1:]) for j in range(len(base))]
    return [*dims, *(math.prod(base) if i is None else strides[i] for i in axis_of)]


def _operand(g: ChainGraph, v: relax.Var, reader: relax.Var
             ) -> tuple[relax.Var, list[int], list[relax.Var], float] | None:
    """``(x, view, gone, scale)`` where operand ``v`` is ``x`` (a float32 activation) through
    transposes, reshapes that add or drop axes of 1 and products by a scalar, each read by
    the next alone: the kernel reads ``x`` through ``view`` and scales its product instead."""
    dims = tuple(static_dims(v.ty))
    axis_of: list[int | None] = [None if d == 1 else i for i, d in enumerate(dims)]
    gone, scale, c, last = [], 1.0, v, reader
    while isinstance(c, relax.DataflowVar) and c not in g.claimed:
        user = g.only_user(c)
        step = _step_back(g, c, axis_of) if user is not None and user.var.same_as(last) \
            else None
        if step is None:
            break
        gone.append(c)
        last, (c, axis_of, k) = c, step
        scale *= k
    if not gone or _float32(c, g) is None:
        return None
    return c, _view(dims, axis_of, tuple(static_dims(c.ty))), gone, scale


def _result(g: ChainGraph, end: relax.Var) -> tuple[relax.Var, list[int], list[relax.Var]]:
    """``(y, view, ops)``: the product ``end`` goes on through transposes and reshapes that
    add or drop axes of 1 (``ops``, each read by the next alone) to ``y``: the kernel writes
    ``y`` through ``view``."""
    dims = tuple(static_dims(end.ty))
    axis_of: list[int | None] = [None if d == 1 else i for i, d in enumerate(dims)]
    ops, c = [], end
    while True:
        user = g.only_user(c)
        if user is None or not isinstance(user.var, relax.DataflowVar) or user.var in g.claimed \
                or op_name(user.value) not in ("relax.permute_dims", "relax.reshape") \
                or not user.value.args[0].same_as(c):
            break
        back = _step_back(g, user.var, list(range(len(static_dims(user.var.ty) or ()))))
        if back is None:
            break
        # back[1][j]: c's axis that the next's axis j is (None: an axis of 1)
        to_next = {i: j for j, i in enumerate(back[1]) if i is not None}
        if any(i is not None and i not in to_next for i in axis_of):
            break
        axis_of = [None if i is None else to_next[i] for i in axis_of]
        ops.append(user.var)
        c = user.var
    return c, _view(dims, axis_of, tuple(static_dims(c.ty))), ops


def _matmul(g: ChainGraph, b: relax.VarBinding) -> RowOp | None:
    """Two activations of rank 2 or more, the batch dims broadcast; an add after it of a
    float32 tensor that broadcasts onto the product (read by nothing else) is its post-op.
    Transposes, reshapes that add or drop axes of 1 and products by a scalar that only feed
    an operand, a product or quotient by a scalar right after it, and transposes and such
    reshapes that only read the result (attention's heads split off, scaled and merged back),
    are read or written through strided views or folded into a scale of the product
    (``params``, int64: each view's dims and strides, then the scale's float32 bits) and go."""
    a, w = b.value.args
    sa, sw, out = _float32(a, g), _float32(w, g), static_dims(b.var.ty)
    if (sa is None or sw is None or out is None or len(sa) < 2 or len(sw) < 2
            or str(b.value.attrs.out_dtype) not in ("", "None", "void", "float32")):
        return None
    out = tuple(out)
    rank = len(out)
    op = RowOp("matmul", b, [a, w], [b.var], label=["matmul"],
               macs=math.prod(out) * sa[-1])
    views: list[list[int] | None] = [None, None, None]
    gone: list[relax.Var] = []
    scale = 1.0
    views_on = os.environ.get("HGRT_ONEDNN_VIEWS") != "0"
    for k, v in enumerate((a, w)):
        seen = _operand(g, v, b.var) if views_on and len(_float32(v, g)) == rank else None
        if seen is not None:
            op.args[k], views[k] = seen[0], seen[1]
            gone += seen[2]
            scale *= seen[3]
    then = g.only_user(b.var) if views_on else None
    if (then is not None and op_name(then.value) in ("relax.multiply", "relax.divide")
            and then.var not in g.claimed and static_dims(then.var.ty) == out):
        scaled = _scalar_of(g, then.value)  # the scores' scale after the product (GPT-2's)
        if scaled is not None and scaled[0].same_as(b.var):
            scale *= scaled[1]
            op.members.append(then.var)
            op.label.append("scale")
    add = g.only_user(op.end)
    if add is not None and op_name(add.value) == "relax.add" and add.var not in g.claimed:
        lhs, rhs = add.value.args
        d = rhs if lhs.same_as(op.end) else lhs
        dims = static_dims(d.ty) if isinstance(d, relax.Var) else None
        if (dims is not None and not d.same_as(op.end) and str(d.ty.dtype) == "float32"
                and static_dims(add.var.ty) == out and _broadcasts(tuple(dims), out)
                and _fast_addend(tuple(dims), out)):
            op.args.append(d)
            op.members.append(add.var)
            op.label.append("add")
    if not views_on:  # HGRT_ONEDNN_VIEWS=0: none (to time the difference they make)
        return op
    _, view, after = _result(g, op.end)
    if after:
        views[2] = view
        op.members += after
    if any(v is not None for v in views) or scale != 1.0:
        def plain(shape: tuple[int, ...]) -> list[int]:  # leading 1s up to the rank
            pad = rank - len(shape)
            return _view((1,) * pad + shape, [None] * pad + list(range(len(shape))), shape)
        rows = [v if v is not None else plain(shape) for v, shape in
                zip(views, (tuple(sa), tuple(sw), out), strict=True)]
        bits = int(np.array(scale, "float32").view("uint32"))
        op.params = np.array([x for r in rows for x in r] + [bits], "int64")
        op.members = gone + op.members  # (every member but the last goes)
        op.label.append("views")
    return op


FINDERS = {"relax.nn.layer_norm": _layer_norm, "relax.nn.softmax": _softmax,
           "relax.matmul": _matmul}


def find_rows(g: ChainGraph, kernels: Kernels,
              claim: frozenset[str] = frozenset({"auto", "onednn"})) -> list[RowOp]:
    """The ops of ``main`` (``FINDERS``) that oneDNN's row kernels can compute and ``kernels``
    lets a provider in ``claim`` take, on an x86-64 CPU, none claimed by a chain, every member
    on the root's device."""
    ctx, rows = g.ctx, []
    taken = set(g.claimed)
    for b in bindings(g.func):
        find = FINDERS.get(op_name(b.value))
        if find is None or b.var in taken:
            continue
        choice, _ = kernels.choice(b.var.name, op_name(b.value))
        device = ctx.placed.op_device.get(b.var.name)
        if choice not in claim or device is None or not runs_onednn(ctx, device):
            continue
        op = find(g, b)
        if op is None or any(ctx.placed.op_device.get(v.name) != device or v in taken
                             for v in op.members):
            continue
        op.choice = choice
        taken.update(op.members)
        rows.append(op)
    return rows

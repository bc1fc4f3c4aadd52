"""Transcendental functions of CPU kernels as vectorizable float32 arithmetic.

TVM 0.27's LLVM backend turns ``exp``, ``erf`` and ``tanh`` (and ``sigmoid``, made of ``exp``)
in a vectorized loop into one libm call per vector lane, which costs more than the rest of a
GELU, SiLU or Softmax kernel. Here they are written as plain float32 arithmetic (Cody-Waite
range reduction and polynomials, the Cephes single-precision ones; Eigen's rational ``erf``)
that LLVM emits as SIMD instructions. Largest error against a float64 reference over
[-100, 100] (a 2^-8 grid and random points, ``tests/relay_passes/test_cpu_math.py``): ``exp``
and ``tanh`` 1 ulp, ``sigmoid`` 2, ``erf`` 7 (all a relative error under 5e-7); results
that would be denormal are 0 or right to their absolute precision (``vector_exp``).
Special values match libm: ``exp(-inf) = 0``, ``exp(inf) = inf``, ``tanh(±inf) = erf(±inf) =
±1``, NaN in gives NaN out.

``vector_math_legalizations`` gives ``LegalizeOps`` a rule per Relax op (``exp``, ``erf``,
``tanh``, ``sigmoid``, ``gelu``, ``gelu_tanh``, ``silu``, ``softmax``) that writes these forms
for float32 tensors on CPU devices; any other call keeps TVM's rule. ``HGRT_LIBM=1`` keeps
libm everywhere.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import tvm
from tvm import relax, te, tirx

__all__ = ["VECTOR_MATH", "libm_only", "vector_exp", "vector_erf", "vector_math_legalizations",
           "vector_sigmoid", "vector_tanh"]

_F32 = "float32"


def _c(v: float) -> tirx.PrimExpr:
    return tirx.const(v, _F32)


def _horner(x: tirx.PrimExpr, coeffs: tuple[float, ...]) -> tirx.PrimExpr:
    """``coeffs[0] * x^(n-1) + ... + coeffs[-1]``."""
    acc = _c(coeffs[0])
    for k in coeffs[1:]:
        acc = acc * x + _c(k)
    return acc


def _pow2(n: tirx.PrimExpr) -> tirx.PrimExpr:
    """2^n for an int32 ``n`` in [-126, 127], built from its exponent bits."""
    return tirx.reinterpret(_F32, tirx.shift_left(n + 127, tirx.const(23, "int32")))


# exp(r) - 1 - r - r^2/2 = r^2 * (r * P(r)) on [-ln2/2, ln2/2] (Cephes expf)
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
          1.6666665459e-1, 5.0000001201e-1)


# ln of float32's smallest normal number: below it exp's result is denormal, and 0 here
EXP_FLUSH = -87.33654


def vector_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp(x) of a float32: x = n ln2 + r, exp(r) by polynomial, 2^n in two halves so that
    overflow to inf comes out as libm's. A result below float32's smallest normal number
    (``x < EXP_FLUSH``) is 0: x86 cores take a microcode assist for every denormal result (a
    softmax over swin's shifted windows, most of its entries masked to -100, ran 2.2x slower:
    2334 against 1071 us, AMD EPYC)."""
    # below EXP_FLUSH the result is 0, above 89 inf in float32; the bounds keep n in 2^n's range
    xc = tirx.min(tirx.max(x, _c(EXP_FLUSH)), _c(89.0))
    n = tirx.floor(xc * _c(1.44269504088896341) + _c(0.5))
    r = xc - n * _c(0.693359375) - n * _c(-2.12194440e-4)  # ln2 split: n * hi is exact
    p = _horner(r, _EXP_P) * (r * r) + r + _c(1.0)
    ni = n.astype("int32")
    half = tirx.shift_right(ni, tirx.const(1, "int32"))
    y = tirx.Select(x < _c(EXP_FLUSH), _c(0.0), p * _pow2(half) * _pow2(ni - half))
    return tirx.Select(tirx.isnan(x), x, y)


# tanh(x) = x + x^3 * P(x^2) for |x| < 0.625 (Cephes tanhf)
_TANH_P = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
           -3.33332819422e-1)


def vector_tanh(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """tanh(x) of a float32: a polynomial near 0, 1 - 2 / (exp(2|x|) + 1) elsewhere (±1 at
    ±inf; NaN through ``vector_exp``)."""
    z = x * x
    small = _horner(z, _TANH_P) * z * x + x
    a = tirx.abs(x)
    large = _c(1.0) - _c(2.0) / (vector_exp(a + a) + _c(1.0))
    signed = tirx.Select(x < _c(0.0), -large, large)
    return tirx.Select(a < _c(0.625), small, signed)


# erf(x) = x * P(x^2) / Q(x^2) on [-4, 4] (Eigen's float erf); beyond, erf is ±1 in float32
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)


def vector_erf(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """erf(x) of a float32 by Eigen's rational form (±1 beyond ±4; NaN in, NaN out)."""
    xc = tirx.min(tirx.max(x, _c(-4.0)), _c(4.0))
    z = xc * xc
    y = xc * _horner(z, _ERF_P) / _horner(z, _ERF_Q)
    return tirx.Select(tirx.isnan(x), x, y)


def vector_sigmoid(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """1 / (1 + exp(-x)) (0 at -inf, 1 at inf)."""
    return _c(1.0) / (_c(1.0) + vector_exp(-x))


def _elementwise(f: Callable[[tirx.PrimExpr], tirx.PrimExpr], name: str):
    def te_func(x: te.Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: f(x(*i)), name=name)
    return te_func


def _gelu(v: tirx.PrimExpr) -> tirx.PrimExpr:
    return v * (_c(0.5) + vector_erf(v * _c(0.5 ** 0.5)) * _c(0.5))


def _gelu_tanh(v: tirx.PrimExpr) -> tirx.PrimExpr:
    inner = _c(math.sqrt(2.0 / math.pi)) * v * (_c(1.0) + _c(0.044715) * v * v)
    return _c(0.5) * v * (_c(1.0) + vector_tanh(inner))


# a row reduced through vector partial results takes whole vectors of this many lanes (AVX-512's
# 16 float32, two of AVX2's 8): a softmax row of another length is reduced in two parts
ROW_LANES = 16


def _softmax(x: te.Tensor, axis: int) -> te.Tensor:
    """TOPI's softmax (the same blocks, which ``schedule_rows`` recognizes) with
    ``vector_exp``. A row whose length is no whole number of ``ROW_LANES`` (at least two of
    them) reduces its whole vectors and its last few values apart, then combines them: the
    first part vectorizes (swin's 49 = 48 + 1, ViT's 197 = 192 + 5)."""
    axis = axis % len(x.shape)
    cols = int(x.shape[axis])
    reduced = tuple(d for i, d in enumerate(x.shape) if i != axis)

    def outer(idx):
        return tuple(v for i, v in enumerate(idx) if i != axis)

    def at(idx, k):
        return (*idx[:axis], k, *idx[axis:])

    def rows(name: str, value: Callable, reduce: Callable, combine: Callable) -> te.Tensor:
        whole = cols - cols % ROW_LANES if cols % ROW_LANES and cols >= 2 * ROW_LANES else cols
        k = te.reduce_axis((0, whole), name="k")
        head = te.compute(reduced, lambda *i: reduce(value(at(i, k)), axis=k), name=name)
        if whole == cols:
            return head
        t = te.reduce_axis((0, cols - whole), name="k")  # (from 0: compute_at sizes a
        tail = te.compute(reduced, lambda *i: reduce(value(at(i, whole + t)), axis=t),  # loop
                          name=f"{name}_tail")  # of an axis from another minimum wrongly)
        return te.compute(reduced, lambda *i: combine(head[i], tail[i]), name=f"{name}_all")

    top = rows("T_softmax_maxelem", lambda j: x[j], te.max, tirx.max)
    ex = te.compute(x.shape, lambda *i: vector_exp(x[i] - top[outer(i)]), name="T_softmax_exp")
    tot = rows("T_softmax_expsum", lambda j: ex[j], te.sum, lambda a, b: a + b)
    return te.compute(x.shape, lambda *i: ex[i] / tot[outer(i)], name="T_softmax_norm",
                      attrs={"axis": axis})


# Relax op → (PrimFunc name, TE function of the call's tensor and attrs)
VECTOR_MATH: dict[str, tuple[str, Callable]] = {
    "relax.exp": ("tir_exp", lambda x, a: _elementwise(vector_exp, "compute")(x)),
    "relax.tanh": ("tir_tanh", lambda x, a: _elementwise(vector_tanh, "compute")(x)),
    "relax.erf": ("erf", lambda x, a: _elementwise(vector_erf, "T_erf")(x)),
    "relax.sigmoid": ("tir_sigmoid", lambda x, a: _elementwise(vector_sigmoid, "compute")(x)),
    "relax.nn.gelu": ("gelu", lambda x, a: _elementwise(_gelu, "T_gelu")(x)),
    "relax.nn.gelu_tanh": ("gelu_tanh", lambda x, a: _elementwise(_gelu_tanh, "T_gelu")(x)),
    "relax.nn.silu": ("silu", lambda x, a: _elementwise(
        lambda v: v * vector_sigmoid(v), "T_multiply")(x)),
    "relax.nn.softmax": ("softmax", lambda x, a: _softmax(x, int(a.axis))),
}


def _kinds_by_var(main: relax.Function) -> dict[relax.Var, str]:
    """The target kind of each variable of ``main`` whose device is known: its vdevice, else
    the device of its first operand whose device is known (hgrt places an op where its
    operands are). Calls whose inferred type lost the vdevice (a reduction's, a binary op's
    with a weight) are known this way."""
    kinds = {p: p.ty.vdevice.target.kind.name for p in main.params
             if getattr(p.ty, "vdevice", None) is not None}
    for block in main.body.blocks:
        for b in block.bindings:
            vdev = getattr(b.var.ty, "vdevice", None)
            if vdev is not None:
                kinds[b.var] = vdev.target.kind.name
                continue
            value = b.value
            operands = value.args if isinstance(value, relax.Call) else \
                [value.tuple_value] if isinstance(value, relax.TupleGetItem) else [value]
            known = [kinds[a] for a in operands if isinstance(a, relax.Var) and a in kinds]
            if known:
                kinds[b.var] = known[0]
    return kinds


def _kinds_by_name(main: relax.Function) -> dict[str, str]:
    """``_kinds_by_var`` by variable name, names bound twice left out: LegalizeOps hands its
    rules calls whose operands are copies of ``main``'s variables, with their names."""
    seen: dict[str, int] = {}
    for v in [*main.params, *(b.var for block in main.body.blocks for b in block.bindings)]:
        seen[v.name] = seen.get(v.name, 0) + 1
    return {v.name: k for v, k in _kinds_by_var(main).items() if seen[v.name] == 1}


_kinds_of: dict[int, tuple[relax.Function, dict[str, str]]] = {}


def _on_cpu(call: relax.Call, bb: relax.BlockBuilder | None = None) -> bool:
    """Whether ``call`` runs on a CPU: its vdevice; else its operand's device in the module
    being legalized (``bb``'s); else the target the lowering runs under (the first device's:
    right for a build on one device)."""
    vdev = getattr(call.ty, "vdevice", None)
    if vdev is not None:
        return vdev.target.kind.name == "llvm"
    if bb is not None and isinstance(call.args[0], relax.Var):
        mod = bb.get()
        main = mod["main"] if any(g.name_hint == "main" for g in mod.get_global_vars()) else None
        if main is not None:
            cached = _kinds_of.get(id(main))
            if cached is None or not cached[0].same_as(main):
                _kinds_of.clear()  # one module at a time
                cached = _kinds_of[id(main)] = (main, _kinds_by_name(main))
            kind = cached[1].get(call.args[0].name)
            if kind is not None:
                return kind == "llvm"
    target = tvm.target.Target.current(allow_none=True)
    return target is not None and target.kind.name == "llvm"


def _rule(op_name: str) -> Callable:
    name, te_func = VECTOR_MATH[op_name]
    default = tvm.ir.Op.get(op_name).get_attr("FLegalize")

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        arg = call.args[0]
        if getattr(arg.ty, "dtype", None) != _F32 or not _on_cpu(call, bb):
            return default(bb, call)
        return bb.call_te(lambda x: te_func(x, call.attrs), arg, primfunc_name_hint=name)

    return legalize


def libm_only() -> bool:
    """``HGRT_LIBM=1``: every kernel keeps libm's transcendental functions."""
    return os.environ.get("HGRT_LIBM", "0") == "1"


def vector_math_legalizations() -> dict[str, Callable]:
    """``LegalizeOps``'s ``customize_legalize_map``: the ops of ``VECTOR_MATH`` on float32 CPU
    tensors in vectorizable form; empty with ``HGRT_LIBM=1``."""
    if libm_only():
        return {}
    return {op: _rule(op) for op in VECTOR_MATH}

"""Converters of ONNX element-wise ops where TVM's import writes them in a form the passes
cannot read: ``Clip`` becomes ``R.maximum`` / ``R.minimum`` of its bounds (TVM writes
``call_tir`` kernels of its own, a bound baked into one of them, which no pass sees as a
maximum or minimum), so that ``patterns`` makes one ``R.clip`` of constant bounds.

A bound that is a constant has a NaN replaced by no bound here (as ONNX and onnxruntime
treat it); a bound that is a tensor (a weight, an input) is replaced at run time, by
``where(isnan(bound), -inf or inf, bound)`` (done once at build for a weight)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax


def _bound(bb: relax.BlockBuilder, bound: relax.Expr, dtype: str, lowest: bool) -> relax.Expr:
    """``bound`` with NaN meaning no bound (-inf for the lower, inf for the upper)."""
    if np.dtype(dtype).kind != "f":
        return bound
    none = -np.inf if lowest else np.inf
    if isinstance(bound, tvm.ir.GenericConst):
        value = bound.value.numpy()
        return relax.const(np.where(np.isnan(value), none, value).astype(value.dtype))
    return bb.emit(relax.op.where(relax.op.isnan(bound), relax.const(none, dtype), bound))


def convert_clip(bb: relax.BlockBuilder, inputs: list, attrs: dict, opset: int
                 ) -> relax.Expr | None:
    """``Clip`` as a maximum with its lower bound, then a minimum with its upper bound (either
    left out where the node has none)."""
    x = inputs[0]
    dtype = str(x.ty.dtype)
    if opset < 11:
        lo, hi = attrs.get("min"), attrs.get("max")
        bounds = [None if v is None else relax.const(float(v), dtype) for v in (lo, hi)]
    else:
        bounds = [inputs[i] if i < len(inputs) else None for i in (1, 2)]
    out = x
    for bound, lowest, op in ((bounds[0], True, relax.op.maximum),
                              (bounds[1], False, relax.op.minimum)):
        if bound is not None:
            out = bb.emit(op(out, _bound(bb, bound, dtype, lowest)))
    return out


CONVERTERS = {"Clip": convert_clip}

"""Converters of ONNX ops that make or move tensors, where TVM's import is wrong:
``ConstantOfShape`` of an empty shape is a scalar (TVM broadcasts the (1,) value to shape ()
and fails); ``Slice`` before opset 10 takes its starts, ends and axes as attributes (TVM's
converter reads them as inputs only)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from hgrt.importer.converter import ConversionError, static_shape
from hgrt.relay_passes.util.relax_util import static_dims


def convert_constant_of_shape(bb: relax.BlockBuilder, inputs: list, attrs: dict, opset: int
                              ) -> relax.Expr | None:
    """A scalar for an empty shape (a constant, or any tensor of static shape (0,)); anything
    else is TVM's."""
    shape = inputs[0]
    empty = shape.value.numpy().size == 0 if isinstance(shape, tvm.ir.GenericConst) \
        else static_dims(shape.ty) == (0,)
    if not empty:
        return None
    from onnx import numpy_helper

    value = attrs.get("value")
    fill = numpy_helper.to_array(value).reshape(-1)[0] if value is not None \
        else np.float32(0)
    return relax.const(np.asarray(fill))


def _clamped(index: int, dim: int) -> int:
    """An ONNX slice bound (negative from the end, any size) within ``[0, dim]``."""
    return min(max(index + dim if index < 0 else index, 0), dim)


def convert_slice_v1(bb: relax.BlockBuilder, inputs: list, attrs: dict, opset: int
                     ) -> relax.Expr | None:
    """Slice-1 (opset < 10): ``starts``, ``ends`` and optional ``axes`` attributes, step 1, on
    a tensor of static shape; Slice-10 and later are TVM's."""
    if opset >= 10:
        return None
    x = inputs[0]
    shape = static_shape(x, "the sliced tensor")
    starts, ends = list(attrs.get("starts", ())), list(attrs.get("ends", ()))
    axes = list(attrs.get("axes", range(len(starts))))
    if not (len(starts) == len(ends) == len(axes)):
        raise ConversionError(f"starts {starts}, ends {ends} and axes {axes} differ in length")
    axes = [int(a) + len(shape) if int(a) < 0 else int(a) for a in axes]
    if any(not 0 <= a < len(shape) for a in axes):
        raise ConversionError(f"axes {axes} outside the tensor's {len(shape)} dimensions")
    begin = [_clamped(int(b), shape[a]) for b, a in zip(starts, axes, strict=True)]
    end = [max(_clamped(int(e), shape[a]), b)
           for e, a, b in zip(ends, axes, begin, strict=True)]
    return relax.op.strided_slice(x, axes, begin, end, assume_inbound=True)


CONVERTERS = {"ConstantOfShape": convert_constant_of_shape, "Slice": convert_slice_v1}

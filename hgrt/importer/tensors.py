"""Converters of ONNX ops that make tensors, where TVM's import is wrong: ``ConstantOfShape``
of an empty shape is a scalar (TVM broadcasts the (1,) value to shape () and fails)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

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


CONVERTERS = {"ConstantOfShape": convert_constant_of_shape}

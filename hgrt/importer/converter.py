"""What a converter is: ``convert(bb, inputs, attrs, opset) -> relax.Expr | None``. ``bb`` is
the block builder of TVM's import, ``inputs`` the node's inputs as Relax expressions (None
where the node leaves an optional input out), ``attrs`` its attributes as TVM's import parses
them plus ``"op_type"``. It emits what it needs into ``bb`` and returns the node's value (a
tuple for several outputs), or None to leave the node to TVM's own converter. It raises
``ConversionError`` saying what is missing; the importer adds the node's name and op.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax

from hgrt.relay_passes.util.relax_util import static_dims

Converter = Callable[[relax.BlockBuilder, list, dict, int], "relax.Expr | None"]


class ConversionError(Exception):
    """A converter cannot convert a node: the message says what is missing."""


def static_shape(expr: relax.Expr, what: str) -> tuple[int, ...]:
    """The static shape of the tensor ``expr`` (the node's ``what``), or a ConversionError."""
    shape = static_dims(expr.ty)
    if shape is None:
        raise ConversionError(f"{what} has no static shape ({expr.ty}); give the model's "
                              f"inputs static shapes (input_shapes=...)")
    return shape

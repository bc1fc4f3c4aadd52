"""TVM's ONNX import with hgrt's converters in it: ``import_onnx`` runs TVM's
``ONNXGraphImporter`` with ``rules.CONVERTERS`` consulted before TVM's own converters, and
names the node, its op and what is missing when a node cannot be imported."""

from __future__ import annotations

from typing import Any

import tvm
from tvm.relax.frontend.onnx import onnx_frontend

from hgrt.errors import BuildError, HgrtError
from hgrt.importer.converter import ConversionError
from hgrt.importer.rules import CONVERTERS

# what TVM's import handles outside its converter table
_HANDLED_APART = {"If", "Constant"}


class _Importer(onnx_frontend.ONNXGraphImporter):
    """TVM's importer, its converters overridden by hgrt's per op type."""

    def _check_for_unsupported_ops(self, graph: Any) -> None:
        theirs = onnx_frontend._get_convert_map()
        missing = [n for n in graph.node if n.op_type not in CONVERTERS
                   and n.op_type not in theirs and n.op_type not in _HANDLED_APART]
        if missing:
            shown = ", ".join(f"{n.name!r} ({n.op_type})" for n in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise BuildError(f"the ONNX import has no converter for node {shown}{more}: "
                             f"neither TVM's ONNX frontend nor hgrt converts "
                             f"{sorted({n.op_type for n in missing})}")

    def _convert_operator(self, op_name: str, inputs: list, attrs: dict, opset: int) -> Any:
        node = attrs.get("tvm_custom", {}).get("name", "")
        try:
            converted = None
            if op_name in CONVERTERS:
                converted = CONVERTERS[op_name](self.bb, inputs, {**attrs, "op_type": op_name},
                                                opset)
            if converted is None:
                return super()._convert_operator(op_name, inputs, attrs, opset)
            return self.bb.normalize(converted)
        except HgrtError:
            raise
        except Exception as e:
            what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            source = "" if isinstance(e, ConversionError) else " (TVM's ONNX converter)"
            raise BuildError(f"cannot import node {node!r} ({op_name}){source}: {what}") from e


def _opset(model: Any) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return 1


def named_nodes(model: Any) -> None:
    """Give every unnamed node of ``model`` (in place) a name, from its op and first output,
    so that an error can name it."""
    taken = {n.name for n in model.graph.node}
    for node in model.graph.node:
        if not node.name:
            name = f"{node.op_type}:{node.output[0] if node.output else len(taken)}"
            node.name = name if name not in taken else f"{name}#{len(taken)}"
            taken.add(node.name)


def import_onnx(model: Any, shape_dict: dict[str, list[int]] | None) -> tvm.IRModule:
    """``model`` (a ModelProto, as TVM's ``from_onnx`` takes it, params kept as inputs and the
    model's own input names) as a Relax module."""
    if model.ir_version < 3:
        raise BuildError(f"ONNX IR version {model.ir_version} is older than TVM imports (3)")
    importer = _Importer(shape_dict, "float32", keep_params_in_input=True, sanitize=False)
    return importer.from_onnx(model.graph, _opset(model))

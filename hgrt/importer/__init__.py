"""hgrt's part of importing a model: what TVM's ONNX import lacks or gets wrong, one module per
idea, every rule table keyed by op type.

* ``onnx_graph.import_onnx``: TVM's ONNX importer with hgrt's converters consulted first, each
  failure naming the node, its op and what is missing;
* ``rules.CONVERTERS``: the converters by ONNX op type (what one is: ``converter.py``),
  gathered from one module per family:
  ``recurrent.py`` (``LSTM``, ``GRU``, ``RNN`` as one ``R.call_tir`` per layer, its kernel in
  ``recurrent_kernels.py``), ``tensors.py`` (``ConstantOfShape`` of an empty shape),
  ``elementwise.py`` (``Clip`` as ``R.maximum`` / ``R.minimum``);
* ``fold_shapes.fold_static_shapes``: the shape arithmetic of a model whose input shapes are
  static (``Shape``, ``Gather``, ``Concat``, ``ConstantOfShape``, ``Range``, ...) evaluated on
  the ONNX graph before TVM sees it, as onnxruntime's constant folding does;
* ``patterns.recognised_patterns``: after import (of ONNX and Relax alike), the subgraphs that
  are one op (Clip, SiLU, HardSwish, GELU, LayerNorm) made that op, ``patterns.PATTERNS``
  keyed by the op of each pattern's last binding.
"""

from hgrt.importer.converter import ConversionError
from hgrt.importer.fold_shapes import fold_static_shapes
from hgrt.importer.onnx_graph import import_onnx, named_nodes
from hgrt.importer.patterns import recognised_patterns
from hgrt.importer.rules import CONVERTERS

__all__ = ["CONVERTERS", "ConversionError", "fold_static_shapes", "import_onnx", "named_nodes",
           "recognised_patterns"]

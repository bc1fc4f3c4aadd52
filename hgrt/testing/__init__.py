"""Test helpers that ship with hgrt (as ``tvm.testing`` / ``numpy.testing`` do with theirs).

What hgrt's tests and benchmark scripts share:

* the oracles, outside hgrt: ``reference`` runs an ONNX file on onnxruntime (or ONNX's
  reference evaluator), never through hgrt's import (``onnx_reference``), and a Relax module
  through ``tvm.compile`` + the Relax VM (``run_relax_vm``); ``run_lowered_vm`` runs an already
  lowered (fused) module, e.g. ``fused_module``'s;
* random weights that keep outputs informative: ``calibrated`` scales a model's last layer so
  its logits have a standard deviation of a few units (``zoo_model``: a calibrated zoo model),
  ``one_hot_rows`` counts outputs a comparison would see only the argmax of, and
  ``assert_close_to`` compares with the oracle and refuses a one-hot one;
* running an ``hgrt.build`` result on ``tvm.cpu(0)``, ``tvm.cpu(1)``, … (``run_hgrt``) and an
  adversarial placement that alternates ops between devices (``alternating``), also written
  into the Relax module itself as a user would (``user_placed``);
* the ONNX backend test cases of the onnx wheel (``onnx_case_names``, ``load_case``,
  ``case_inputs``, ``check_case``) and a small conv model (``conv_model``);
* for the runtime alone: TVM-built elementwise kernels (``elementwise_lib``) and a graph-JSON
  builder (``GraphBuilder``) on vectors of ``N`` floats.

One module per idea, every name importable from ``hgrt.testing``: ``oracle`` (the references and
the comparison), ``builds`` (running hgrt builds, placements), ``models`` (calibrated weights,
the zoo, a conv model), ``onnx_cases`` (the backend test cases), ``graphs`` (the runtime alone).

>>> import numpy as np
>>> import hgrt
>>> from hgrt.testing import alternating, conv_model, reference, run_hgrt
>>> model = conv_model()
>>> x = np.ones((1, 3, 8, 8), "float32")
>>> res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
>>> got = run_hgrt(res, {"x": x})
>>> np.testing.assert_allclose(got[0], reference(model, {"x": x})[0], rtol=1e-5)

The heavy imports (onnx, the Relax stack) happen inside the functions that need them.
"""

from hgrt.testing.builds import (
    alternating,
    build_and_compare,
    fused_module,
    input_names,
    input_shape,
    onnx_inputs,
    run_hgrt,
    user_placed,
)
from hgrt.testing.graphs import GraphBuilder, N, add_one_chain, elementwise_lib
from hgrt.testing.models import (
    LOGITS_STD,
    calibrated,
    conv_model,
    matmul_module,
    zoo_input,
    zoo_model,
)
from hgrt.testing.onnx_cases import (
    CASE_DIRS,
    OnnxCase,
    case_inputs,
    check_case,
    load_case,
    onnx_case_names,
)
from hgrt.testing.oracle import (
    assert_close_to,
    one_hot_rows,
    onnx_reference,
    reference,
    run_lowered_vm,
    run_relax_vm,
)

__all__ = [
    "LOGITS_STD", "N", "GraphBuilder", "OnnxCase", "alternating", "assert_close_to", "calibrated",
    "case_inputs", "check_case", "conv_model", "elementwise_lib", "fused_module", "input_names",
    "input_shape", "load_case", "matmul_module", "one_hot_rows", "onnx_case_names",
    "onnx_reference", "reference", "run_hgrt", "run_lowered_vm", "run_relax_vm", "user_placed",
    "zoo_input", "zoo_model",
    "CASE_DIRS", "add_one_chain", "build_and_compare", "onnx_inputs"
]

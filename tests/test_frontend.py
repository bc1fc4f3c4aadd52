"""ONNX import: quiet on the zoo, shapes known at build folded, data-dependent ones refused."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

import hgrt
from hgrt.frontend import import_model
from hgrt.testing import case_inputs, load_case, run_hgrt
from hgrt.zoo import light_model


def test_zoo_import_prints_no_frontend_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import_model(light_model("squeezenet"))
    assert [str(w.message) for w in caught] == []


def _expand(shape_init: bool):
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [3])
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["y"])], "expand",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 1])] + ([] if shape_init
                                                                           else [shape]),
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [3], [2, 3, 4])]
        if shape_init else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_shape_known_at_build_is_folded():
    res = hgrt.build(_expand(shape_init=True), ["cpu:0", "cpu:1"])
    x = np.arange(3, dtype="float32").reshape(3, 1)
    np.testing.assert_array_equal(run_hgrt(res, {"x": x})[0], np.broadcast_to(x, (2, 3, 4)))


@pytest.mark.parametrize("model", [_expand(shape_init=False),
                                   load_case("simple/test_expand_shape_model3").model_path])
def test_data_dependent_shape_is_refused_naming_the_op(model):
    with pytest.raises(hgrt.BuildError, match=r"binding '\w+' \(vm.builtin.tensor_to_shape\): "
                                              r"the shape is data-dependent \(read from 'shape'"):
        hgrt.build(model, ["cpu:0"])


def test_sequence_insert_at_a_negative_position():
    """ONNX inserts at n + p, TVM 0.27's import at n + p + 1 (the Relax VM gets it wrong)."""
    case = load_case("simple/test_sequence_model3")
    got = run_hgrt(hgrt.build(case.model_path, ["cpu:0"]), case_inputs(case))
    np.testing.assert_array_equal(got[0], case.outputs[0])

"""A model hgrt cannot import says which node, of which op, and what is missing."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper
from recurrent_onnx_models import recurrent_model

import hgrt


def _one_node(node, inputs, opset=17, domains=()):
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                   *(helper.make_opsetid(d, 1) for d in domains)])


def test_an_op_nobody_converts_is_named_with_its_node():
    node = helper.make_node("FancyNorm", ["x"], ["y"], name="norm_7", domain="com.example")
    model = _one_node(node, [("x", TensorProto.FLOAT, [2, 3])], domains=["com.example"])
    with pytest.raises(hgrt.BuildError, match=r"no converter for node 'norm_7' \(FancyNorm\)"):
        hgrt.build(model, ["cpu:0"])


def test_a_recurrent_layer_of_dynamic_length_names_the_node_and_the_shape():
    model = recurrent_model("GRU")
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.Clear()
    dim.dim_param = "time"
    model.graph.node[0].name = "encoder_gru"
    with pytest.raises(hgrt.BuildError, match=r"cannot import node 'encoder_gru' \(GRU\): X has "
                                              r"no static shape"):
        hgrt.build(model, ["cpu:0"])


def test_a_failure_of_tvms_converter_names_the_node():
    node = helper.make_node("Pad", ["x", "pads"], ["y"])  # unnamed: named after its output
    model = _one_node(node, [("x", TensorProto.FLOAT, [2, 3]), ("pads", TensorProto.INT64, [4])])
    with pytest.raises(hgrt.BuildError, match=r"cannot import node 'Pad:y' \(Pad\) \(TVM's ONNX "
                                              r"converter\): Dynamic pads"):
        hgrt.build(model, ["cpu:0"])


def test_an_unknown_activation_is_named():
    model = recurrent_model("RNN", activations=["Swish"])
    with pytest.raises(hgrt.BuildError, match=r"\(RNN\): activation 'Swish' is not one ONNX"):
        hgrt.build(model, ["cpu:0"])

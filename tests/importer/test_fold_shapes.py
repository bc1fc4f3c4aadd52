"""Shape arithmetic on static shapes folded before TVM's import: what torch exporters write
(GPT-2's scalar ConstantOfShape, a Shape->Gather->Concat->Reshape chain, a channel split at
ends read from Shape, position ids from Range) builds without a run-time shape and matches
onnxruntime, on one device and split over cpu:0 / cpu:1."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.frontend import import_model
from hgrt.importer import fold_static_shapes
from hgrt.testing import alternating, onnx_reference, run_hgrt


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _i64(*v):
    return np.array(v, "int64")


def scalar_constant_of_shape():
    """GPT-2's attention: a scalar made by ConstantOfShape of an empty shape."""
    return _model([
        helper.make_node("ConstantOfShape", ["empty"], ["fill"],
                         value=numpy_helper.from_array(np.array([-2.5], "float32"))),
        helper.make_node("Mul", ["x", "fill"], ["y"])],
        [("x", TensorProto.FLOAT, [2, 5])], ["y"], [("empty", np.zeros(0, "int64"))])


def reshape_by_shape_chain():
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape, as exporters flatten."""
    return _model([
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Reshape", ["r", "target"], ["y"])],
        [("x", TensorProto.FLOAT, [2, 3, 4])], ["y"],
        [("zero", np.array(0, "int64")), ("axes0", _i64(0)), ("minus1", _i64(-1))])


def channel_split():
    """ShuffleNetV2's split: slice ends from Shape(x)[1] / 2, the halves joined again."""
    return _model([
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["c"], axis=0),
        helper.make_node("Div", ["c", "two"], ["half"]),
        helper.make_node("Unsqueeze", ["half", "axes0"], ["half1"]),
        helper.make_node("Slice", ["x", "zeros", "half1", "axes1"], ["a"]),
        helper.make_node("Slice", ["x", "half1", "big", "axes1"], ["b"]),
        helper.make_node("Sigmoid", ["b"], ["bs"]),
        helper.make_node("Concat", ["bs", "a"], ["y"], axis=1)],
        [("x", TensorProto.FLOAT, [1, 8, 3, 3])], ["y"],
        [("one", np.array(1, "int64")), ("two", np.array(2, "int64")), ("axes0", _i64(0)),
         ("zeros", _i64(0)), ("axes1", _i64(1)), ("big", _i64(2 ** 62))])


def position_ids():
    """Range over Shape(ids)[1], Unsqueeze, Expand, Cast, Equal and Where: positions and a
    mask as decoders export them."""
    return _model([
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
        helper.make_node("Range", ["zero", "n", "one"], ["pos"]),
        helper.make_node("Unsqueeze", ["pos", "axes0"], ["pos1"]),
        helper.make_node("Expand", ["pos1", "s"], ["pos2"]),
        helper.make_node("Equal", ["pos2", "zero"], ["first"]),
        helper.make_node("Cast", ["pos2"], ["posf"], to=TensorProto.FLOAT),
        helper.make_node("Where", ["first", "neg", "posf"], ["bias"]),
        helper.make_node("Add", ["x", "bias"], ["y"])],
        [("x", TensorProto.FLOAT, [2, 6])], ["y"],
        [("zero", np.array(0, "int64")), ("one", np.array(1, "int64")), ("axes0", _i64(0)),
         ("neg", np.array(-10.0, "float32"))])


def quantized_pad_value():
    """A Pad whose constant value is quantized and dequantized (a QDQ model's padded conv, as
    onnxruntime's quantize_static writes it): TVM's Pad needs the value as a constant."""
    return _model([
        helper.make_node("QuantizeLinear", ["value", "scale", "zp"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["dq"]),
        helper.make_node("Pad", ["x", "pads", "dq"], ["y"], mode="constant")],
        [("x", TensorProto.FLOAT, [2, 5])], ["y"],
        [("value", np.array(0.5, "float32")), ("scale", np.array(0.25, "float32")),
         ("zp", np.array(0, "int8")), ("pads", _i64(0, 1, 1, 2))])


MODELS = {"scalar_constant_of_shape": scalar_constant_of_shape,
          "reshape_by_shape_chain": reshape_by_shape_chain, "channel_split": channel_split,
          "position_ids": position_ids, "quantized_pad_value": quantized_pad_value}


def test_a_dequantized_constant_folds_at_opset_17():
    """ONNX's reference evaluator has DequantizeLinear from opset 19 only; it folds anyway."""
    folded = fold_static_shapes(quantized_pad_value())
    assert [n.op_type for n in folded.graph.node] == ["Constant", "Pad"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shape_arithmetic_folds_to_constants(name):
    model = MODELS[name]()
    folded = fold_static_shapes(model)
    ops = [n.op_type for n in folded.graph.node]
    assert not {"Shape", "ConstantOfShape", "Range", "Gather"} & set(ops), ops
    # TVM's import sees no run-time shape: no binding of main has a shape type
    mod, _ = import_model(model)
    text = mod["main"].script()
    assert "tensor_to_shape" not in text and "R.Shape(ndim" not in text


@pytest.mark.parametrize("placement", ["single", "split"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_folded_models_match_onnxruntime(name, placement):
    model = MODELS[name]()
    rng = np.random.default_rng(0)
    x = rng.standard_normal([d.dim_value for d in model.graph.input[0].type.tensor_type
                             .shape.dim]).astype("float32")
    res = hgrt.build(model, ["cpu:0"]) if placement == "single" else \
        hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    got = run_hgrt(res, {"x": x})
    want = onnx_reference(model, {"x": x})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_input_shapes_given_at_build_fold_too():
    """A model exported with a symbolic batch, built at batch 3: its Shape chain folds."""
    model = reshape_by_shape_chain()
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.Clear()
    dim.dim_param = "batch"
    assert [n.op_type for n in fold_static_shapes(model).graph.node].count("Shape") == 1
    folded = fold_static_shapes(model, {"x": [3, 3, 4]})
    assert "Shape" not in [n.op_type for n in folded.graph.node]
    assert folded.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    x = np.random.default_rng(1).standard_normal((3, 3, 4)).astype("float32")
    got = run_hgrt(hgrt.build(model, ["cpu:0"], input_shapes={"x": [3, 3, 4]}), {"x": x})
    np.testing.assert_allclose(got[0], onnx_reference(model, {"x": x})[0], rtol=1e-6)


def test_nothing_to_fold_gives_the_model_back():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [("x", TensorProto.FLOAT, [2])],
                   ["y"])
    assert fold_static_shapes(model) is model


def test_scalar_constant_of_shape_converts_without_folding():
    """TVM's converter broadcasts the (1,) value to shape () and fails; hgrt's makes the
    scalar (the converter alone, the graph not folded)."""
    from hgrt.importer import import_onnx
    from hgrt.testing import run_relax_vm

    model = scalar_constant_of_shape()
    mod = import_onnx(model, None)
    x = np.random.default_rng(2).standard_normal((2, 5)).astype("float32")
    got = run_relax_vm(mod, [x])
    np.testing.assert_allclose(got[0], onnx_reference(model, {"x": x})[0], rtol=1e-6)


@pytest.mark.parametrize(("split", "want"), [(None, 4), ("sizes", 3), ("chunk", 2)])
def test_a_sequence_length_of_a_split_tensor_folds_even_as_an_output(split, want):
    inputs = [("x", TensorProto.FLOAT, [2, 3, 4])]
    args, inits = ["x"], []
    if split == "sizes":  # one chunk per size given: the sizes' shape says how many
        inputs.append(("s", TensorProto.INT64, [3]))
        args.append("s")
    elif split == "chunk":  # chunks of 3 of an axis of 4: two
        inits.append(("s", _i64(3).reshape(())))
        args.append("s")
    nodes = [helper.make_node("SplitToSequence", args, ["seq"], axis=-1),
             helper.make_node("SequenceLength", ["seq"], ["n"]),
             helper.make_node("Relu", ["x"], ["y"])]
    model = _model(nodes, inputs, ["n", "y"], inits, opset=12)
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.INT64
    folded = fold_static_shapes(model)
    assert [n.op_type for n in folded.graph.node] == ["Constant", "Relu"]
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3, 4)).astype("float32")}
    if split == "sizes":
        feed["s"] = _i64(1, 1, 2)
    for res in (hgrt.build(model, ["cpu:0"]),
                hgrt.build(model, ["cpu:0", "cpu:1"],
                           hgrt.Placement(rules={"nn.relu": "cpu:1"}, fallback="cpu:0"))):
        got = run_hgrt(res, feed)
        assert int(got[0]) == want == int(onnx_reference(model, feed)[0])
        np.testing.assert_array_equal(got[1], np.maximum(feed["x"], 0))


def test_an_initializer_listed_as_an_input_leaves_with_the_nodes_that_read_it():
    """Old exporters list initializers as inputs: once a transpose of one folds, neither the
    initializer nor its input entry is left (the model's inputs stay its real ones)."""
    w = np.random.default_rng(1).standard_normal((5, 4)).astype("float32")
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["y"])]
    model = _model(nodes, [("x", TensorProto.FLOAT, [2, 4]), ("w", TensorProto.FLOAT, [5, 4])],
                   ["y"], [("w", w)], opset=9)
    folded = fold_static_shapes(model)
    assert [i.name for i in folded.graph.input] == ["x"]
    x = np.random.default_rng(2).standard_normal((2, 4)).astype("float32")
    got = run_hgrt(hgrt.build(model, ["cpu"]), {"x": x})
    np.testing.assert_allclose(got[0], x @ w.T, rtol=1e-5)


@pytest.mark.parametrize(("starts", "ends", "axes"), [
    ([1], [3], [0]), ([-3, 0], [2**63 - 1, -1], [1, 2]), ([0, 1], [1, 10], None)])
def test_slice_before_opset_10_takes_its_bounds_from_attributes(starts, ends, axes):
    attrs = {"starts": starts, "ends": ends} | ({"axes": axes} if axes is not None else {})
    model = _model([helper.make_node("Slice", ["x"], ["y"], **attrs)],
                   [("x", TensorProto.FLOAT, [4, 5, 6])], ["y"], opset=9)
    x = np.random.default_rng(3).standard_normal((4, 5, 6)).astype("float32")
    want = onnx_reference(model, {"x": x})[0]
    for res in (hgrt.build(model, ["cpu:0"]),
                hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))):
        np.testing.assert_array_equal(run_hgrt(res, {"x": x})[0], want)

"""build()'s options checked before anything is compiled: a typo or a bad value was ignored, or
failed only after the whole library was built (found in review, session 23)."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

import hgrt
from hgrt.testing import conv_model


def _relu(shape):
    w = helper.make_tensor("w", TensorProto.FLOAT, [1], [0.5])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]),
                           helper.make_node("Mul", ["r", "w"], ["y"])], "relu",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("shapes, match", [
    ({"X": [2, 4]}, r"input_shapes: input 'X' not found; known: \['x'\]"),
    ({"x": [2, 4], "z": [1]}, "input 'z' not found"),
    ({"w": [1]}, r"'w' is an initializer \(a weight\), not an input; inputs: \['x'\]"),
    ({"x": [2]}, "the model's input has rank 2"),
    ({"x": [-1, 4]}, "give a list of sizes >= 0"),
    ({"x": "ab"}, "give a list of sizes >= 0"),
])
def test_input_shapes_name_inputs_the_model_has_and_fit_them(shapes, match):
    with pytest.raises(hgrt.BuildError, match=match):
        hgrt.build(_relu(["N", 4]), ["cpu"], input_shapes=shapes)


@pytest.mark.parametrize("dims, shape", [(["N", 4], [3, 4]), ([1, 4], [4, 4])])
def test_input_shapes_that_fit_build(dims, shape):
    """A fixed dimension may change (a model exported at batch 1, built at batch 4)."""
    built = hgrt.build(_relu(dims), ["cpu"], input_shapes={"x": shape})
    assert built.graph.shapes[0] == tuple(shape)


def test_stream_options_take_numpy_numbers():
    import numpy as np

    built = hgrt.build(conv_model(), ["cpu:0", "cpu:1"],
                       streams={"per_device": np.int64(2), "memory_slack": np.float32(0.5),
                                "single_stream": np.False_})
    assert built.graph.streams is not None


@pytest.mark.parametrize("streams, match", [
    ({"per_device": 0}, "'per_device' must be an integer >= 1, got 0"),
    ({"per_device": "2"}, "'per_device' must be an integer >= 1"),
    ({"per_devices": 2}, "'per_devices' not found; did you mean 'per_device'"),
    ({"single_stream": "no"}, "'single_stream' must be True or False"),
    ({"memory_slack": -1}, "'memory_slack' must be a fraction >= 0"),
    ([("per_device", 2)], "streams must be a dict of options"),
])
def test_stream_options_are_checked_first(streams, match, monkeypatch):
    import hgrt.compiler

    def no_import(*a, **k):
        raise AssertionError("the model was imported before the options were checked")

    monkeypatch.setattr(hgrt.compiler, "_context", no_import)
    with pytest.raises(hgrt.BuildError, match=match):
        hgrt.build(conv_model(), ["cpu:0", "cpu:1"], streams=streams)

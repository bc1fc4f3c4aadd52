"""build()'s options checked before anything is compiled: a typo or a bad value was ignored, or
failed only after the whole library was built. And what the stream options do to the graph."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

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


def _two_branches():
    """x -> MatMul(a1) -> Relu -> MatMul(a2) and x -> MatMul(b1) -> Tanh -> MatMul(b2), added:
    two branches of two kernels each (a matmul does not fuse into another). The ONNX model and
    numpy's function of it."""
    rng = np.random.default_rng(0)
    w = {n: (rng.standard_normal((8, 8)) / 4).astype("float32") for n in ("a1", "a2", "b1", "b2")}
    node = helper.make_node
    nodes = [node("MatMul", ["x", "a1"], ["ma"]), node("Relu", ["ma"], ["ra"]),
             node("MatMul", ["ra", "a2"], ["ya"]),
             node("MatMul", ["x", "b1"], ["mb"]), node("Tanh", ["mb"], ["tb"]),
             node("MatMul", ["tb", "b2"], ["yb"]), node("Add", ["ya", "yb"], ["y"])]
    g = helper.make_graph(nodes, "two_branches",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                          [numpy_helper.from_array(v, n) for n, v in w.items()])

    def reference(x: np.ndarray) -> np.ndarray:
        x = x.astype("float64")
        return np.maximum(x @ w["a1"], 0) @ w["a2"] + np.tanh(x @ w["b1"]) @ w["b2"]

    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), reference


def _branch_heads(graph) -> list[int]:
    """The kernels that read the input x: the first of each branch."""
    x = next(n for n in graph.arg_nodes if graph.nodes[n].name == "x")
    return [nid for nid, node in enumerate(graph.nodes)
            if node.func_name and x in [src for src, _, _ in node.inputs]]


def test_stream_options_take_numpy_numbers_and_put_branches_on_streams():
    """``per_device`` (a numpy number) gives the two branches on one device a stream each, in
    the graph JSON, with an event where they join; by default the device has one stream, with
    ``single_stream`` none. Every build computes numpy's values, its streams run at once."""
    model, reference = _two_branches()
    x = np.random.default_rng(1).standard_normal((4, 8)).astype("float32")
    built = {name: hgrt.build(model, ["cpu"], kernels="tvm", streams=streams) for name, streams
             in (("two", {"per_device": np.int64(2), "memory_slack": np.float32(0.5),
                          "single_stream": np.False_}),
                 ("default", None), ("none", {"single_stream": np.True_}))}
    two = built["two"].graph
    heads = _branch_heads(two)
    assert len(heads) == 2 and two.streams[heads[0]] != two.streams[heads[1]]
    assert sum(map(len, two.waits)) >= 1  # the join waits for the other branch
    assert json.loads(built["two"].graph_json)["hgrt"]["streams"] == list(two.streams)
    default = built["default"].graph
    assert {s for s in default.streams if s >= 0} == {0}
    assert built["none"].graph.streams is None
    assert "streams" not in json.loads(built["none"].graph_json).get("hgrt", {})
    for name, res in built.items():
        m = hgrt.create(res.graph, res.lib, tvm.cpu(0))
        m.load_params(res.params)
        m.configure_streams(parallel=True)
        assert (m._streams is not None) == (name == "two")
        m.run(x=x)
        np.testing.assert_allclose(m.get_output(0).numpy(), reference(x), rtol=1e-5,
                                   atol=1e-6, err_msg=name)


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

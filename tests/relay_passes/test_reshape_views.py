"""Reshapes that cost nothing: two in a row are one, and one that makes a model's output from
a kernel's result is a view (``__nop``), not a copying kernel."""

from __future__ import annotations

import warnings

import numpy as np
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import hgrt
from hgrt.compiler import lower_model
from hgrt.graph import NOP_FUNC


def _model(only_reshape: bool = False):
    """x -> softmax -> reshape (2,3,4) -> reshape (6,4) -> softmax -> reshape (24,) = y (a
    softmax fuses no reshape after it); or y = reshape(x, (24,))"""
    shapes = {"s1": [2, 3, 4], "s2": [6, 4], "s3": [24]}
    inits = [numpy_helper.from_array(np.array(v, "int64"), k) for k, v in shapes.items()]
    nodes = [helper.make_node("Reshape", ["x", "s3"], ["y"])] if only_reshape else [
        helper.make_node("Softmax", ["x"], ["a"]),
        helper.make_node("Reshape", ["a", "s1"], ["b"]),
        helper.make_node("Reshape", ["b", "s2"], ["c"]),
        helper.make_node("Softmax", ["c"], ["d"]),
        helper.make_node("Reshape", ["d", "s3"], ["y"])]
    graph = helper.make_graph(nodes, "reshapes", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [4, 6])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [24])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _build(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hgrt.build(model, ["cpu"])


def test_reshapes_in_a_row_and_the_output_reshape_are_views():
    res = _build(_model())
    g = res.graph
    kernels = [n.func_name for n in g.nodes if n.op == "tvm_op" and n.func_name != NOP_FUNC]
    assert len(kernels) == 2 and not [k for k in kernels if "reshape" in k], kernels
    assert sum(n.func_name == NOP_FUNC for n in g.nodes) == 2  # the merged pair, the output
    m = hgrt.create(res.graph_json, res.lib, tvm.cpu(0))
    m.load_params(res.params)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype("float32")
    outs = []
    for sign in (1, -1):  # two runs: the output view follows the new bytes
        m.set_input(x=sign * x)
        m.run()
        outs.append(m.get_output(0).numpy())
    for sign, out in zip((1, -1), outs, strict=True):
        assert out.shape == (24,)
        want = _softmax(_softmax(sign * x).reshape(6, 4)).reshape(24)
        np.testing.assert_allclose(out, want, rtol=1e-6)


def _softmax(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_an_output_reshape_of_the_input_itself_stays_a_copy():
    """Reshape(x) as the output: a view would hand the caller the input's own buffer."""
    res = _build(_model(only_reshape=True))
    g = res.graph
    (out_eid,) = [g.entry_id(n, i) for n, i, *_ in g.heads]
    assert g.alias_roots()[out_eid] == out_eid  # its own bytes, written by a kernel
    assert g.nodes[g.node_of_entry(out_eid)].func_name != NOP_FUNC
    m = hgrt.create(res.graph_json, res.lib, tvm.cpu(0))
    x = np.arange(24, dtype="float32").reshape(4, 6)
    m.set_input(x=x)
    m.run()
    out = m.get_output(0)
    m.set_input(x=-x)  # a new input leaves the last output alone
    np.testing.assert_array_equal(out.numpy(), x.reshape(24))


def test_a_reshape_kernel_that_became_a_view_is_not_built():
    """resnet's tail: pool -> flatten (a view) -> gemm. The flatten's kernel left the lowered
    module: not built into the library, not counted as untuned by a tuning report."""
    w = numpy_helper.from_array(np.ones((5, 4), "float32"), "w")
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "w"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "tail", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 4, 3, 3])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, _ = lower_model(model, ["cpu"])
        res = _build(model)
    kernels = [gv.name_hint for gv, f in mod.functions.items() if not isinstance(f, relax.Function)]
    assert len(kernels) == 2 and not [k for k in kernels if "reshape" in k], kernels
    assert sum(n.func_name == NOP_FUNC for n in res.graph.nodes) == 1
    x = np.random.default_rng(0).standard_normal((1, 4, 3, 3)).astype("float32")
    m = hgrt.create(res.graph_json, res.lib, tvm.cpu(0))
    m.load_params(res.params)
    m.run(x=x)
    want = np.full((1, 5), x.mean(axis=(2, 3)).sum(), "float32")  # ones @ the pooled vector
    np.testing.assert_allclose(m.get_output(0).numpy(), want, rtol=1e-5)


def _conv_zero_pad_conv():
    """a = Conv 1x1 with bias(x); y = Conv 1x1(Pad of zeros(a)) + a: the pad is an identity
    kernel of its own (the first conv has two readers), which TVM's RewriteDataflowReshape turns
    into a view whose type differs from the kernel's (the bias gives ``a`` a vdevice)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype("float32"), "w0"),
             numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype("float32"), "w1"),
             numpy_helper.from_array(rng.standard_normal(4).astype("float32"), "b0"),
             numpy_helper.from_array(np.zeros(8, "int64"), "pads")]
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["a"]),
             helper.make_node("Pad", ["a", "pads"], ["b"]),
             helper.make_node("Conv", ["b", "w1"], ["c"]),
             helper.make_node("Add", ["c", "a"], ["y"])]
    graph = helper.make_graph(nodes, "zero_pad", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 3, 5, 5])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, 4, 5, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_zero_pad_that_became_a_view_keeps_its_reader():
    """The conv after a zero pad reads the view (MobileNetV2's exports have such pads)."""
    from hgrt.testing import build_and_compare

    res = build_and_compare(_conv_zero_pad_conv(), kernels="tvm")
    assert any(n.attrs.get("func_name") == NOP_FUNC for n in res.graph.nodes)

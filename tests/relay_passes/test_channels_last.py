"""channels_last: which tensors oneDNN builds keep NHWC, where they turn back to NCHW, and that
the outputs stay equal to the Relax VM."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.runtime import onednn
from hgrt.testing import run_hgrt, run_relax_vm

REASON = onednn.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"oneDNN unavailable: {REASON}")
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _branchy_onnx(lrn: bool = True):
    """conv → max pool → two convs → concat → avg pool → batch norm → relu → conv → global
    average pool (output ``y``); with ``lrn`` the avg pool's result also feeds an LRN (an op
    with no NHWC form: output ``z``)."""
    rng = np.random.default_rng(0)
    inits = []

    def w(name, *shape):
        inits.append(numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype("float32"), name))
        return name

    def vec(name, n, positive=False):
        v = rng.standard_normal(n).astype("float32")
        inits.append(numpy_helper.from_array(np.abs(v) + 0.5 if positive else v, name))
        return name

    nodes = [
        helper.make_node("Conv", ["x", w("w0", 16, 8, 3, 3)], ["c0"], pads=[1] * 4),
        helper.make_node("Relu", ["c0"], ["a"]),
        helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1] * 4),
        helper.make_node("Conv", ["p", w("w1", 16, 16, 1, 1)], ["b1"]),
        helper.make_node("Conv", ["p", w("w2", 16, 16, 3, 3)], ["b2"], pads=[1] * 4),
        helper.make_node("Concat", ["b1", "b2"], ["c"], axis=1),
        helper.make_node("AveragePool", ["c"], ["ap"], kernel_shape=[3, 3], strides=[1, 1],
                         pads=[1] * 4, count_include_pad=0),
        helper.make_node("BatchNormalization", ["ap", vec("g", 32), vec("be", 32),
                                                vec("m", 32), vec("v", 32, True)], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Conv", ["r", w("w3", 16, 32, 1, 1)], ["d"]),
        helper.make_node("GlobalAveragePool", ["d"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if lrn:
        nodes.append(helper.make_node("LRN", ["ap"], ["z"], size=3))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "branchy", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 12, 12])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _build_and_check(model, devices=("cpu",), placement=None):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 8, 12, 12)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, list(devices), placement, kernels="onednn")
        want = run_relax_vm(model, [x])
    got = run_hgrt(res, {"x": x})
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)
    return res


def _by_func(res, name):
    return [n for n in res.graph.nodes if n.func_name == f"hgrt.onednn.{name}"]


def test_ops_between_onednn_kernels_run_nhwc_and_equal_the_relax_vm():
    res = _build_and_check(_branchy_onnx())
    g = res.graph

    def shape(node):
        return g.shapes[g.entry_id(g.nodes.index(node))]

    (concat,) = _by_func(res, "concat")
    assert shape(concat) == (1, 6, 6, 32)  # N, H, W, C
    assert sorted(shape(p) for p in _by_func(res, "pool")) == [(1, 6, 6, 16), (1, 6, 6, 32)]
    convs = _by_func(res, "conv2d")
    assert [c.attrs["onednn_layouts"] for c in convs] == \
        ["plain, acdb"] + ["acdb, acdb"] * 3  # the model's input NCHW, the rest NHWC
    # batch norm + relu ran NHWC (one TVM kernel); reorders feed only the LRN (TVM decomposes
    # it: x * x runs NHWC, then the pool over channels and the division read NCHW)
    reorders = _by_func(res, "to_nchw")
    assert [shape(r) for r in reorders] == [(1, 32, 6, 6)] * 2
    readers = {g.nodes[i].func_name for i, n in enumerate(g.nodes)
               for r in reorders if any(g.nodes[j] is r for j, *_ in n.inputs)}
    assert readers and not any(f.startswith("hgrt.") for f in readers)
    assert not [n for n in g.nodes if "transpose" in (n.func_name or "")]


def test_a_model_output_is_nchw_and_no_reorder_is_made_that_nothing_needs():
    res = _build_and_check(_branchy_onnx(lrn=False))
    # the global average pool reads NHWC and writes the (1, C, 1, 1) output
    assert not _by_func(res, "to_nchw")


def test_a_copy_to_another_device_gets_nchw():
    """The LRN's pool, power and division run on cpu:1: the avg pool's NHWC result is reordered
    to NCHW on cpu:0, then copied; the outputs equal the VM's."""
    placement = hgrt.Placement(rules={op: "cpu:1" for op in (
        "relax.power", "relax.nn.avg_pool3d", "relax.divide", "relax.squeeze")},
        preferred="cpu:0")
    res = _build_and_check(_branchy_onnx(), ["cpu:0", "cpu:1"], placement)
    g = res.graph
    sources = [g.nodes[n.inputs[0][0]] for n in g.nodes if n.func_name == "__copy"]
    reordered = [s for s in sources if s.func_name == "hgrt.onednn.to_nchw"]
    assert reordered and all(g.entry_device(g.entry_id(g.nodes.index(s))) == 0
                             for s in reordered)
    # nothing NHWC crosses devices: a copy's source is a reorder or no oneDNN node at all
    assert all(s.func_name == "hgrt.onednn.to_nchw" or not s.func_name.startswith("hgrt.")
               for s in sources)
